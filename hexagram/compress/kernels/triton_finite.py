# Triton types a kernel's parameters at launch (tl.constexpr marks the compile-time ones)
# mypy: disable-error-code="no-untyped-def"
"""Triton kernel of the per-tensor finiteness check of a bucket: one read of every element;
a zero written only over a NaN or an Inf, and a flag set for the tensor (segment) that held
it. Blocks without a non-finite element write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hexagram.compress.kernels.triton_bits import BLOCK, FP_OPTIONS, finite

__all__ = ["launch_finite"]


@triton.jit
def _segment_of(starts_ptr, idx, m, segments, LOG: tl.constexpr):
    """The segment of each element ``idx``: the last ``i`` with ``starts[i] <= idx``
    (``starts`` increasing from 0), by a binary search of ``LOG`` halving steps."""
    pos = tl.zeros(idx.shape, tl.int64)
    for k in tl.static_range(LOG):
        cand = pos + (1 << (LOG - 1 - k))
        inside = m & (cand < segments)
        first = tl.load(starts_ptr + cand, mask=inside, other=0)
        pos = tl.where(inside & (first <= idx), cand, pos)
    return pos


@triton.jit
def _finite_kernel(x_ptr, starts_ptr, bad_ptr, n, segments, LOG: tl.constexpr,
                   BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    x = tl.load(x_ptr + idx, mask=m, other=0)
    bad = m & ~finite(x)
    if tl.max(bad.to(tl.int32), 0) > 0:  # rare: clean, find the segments, flag them
        tl.store(x_ptr + idx, tl.zeros_like(x), mask=bad)
        seg = _segment_of(starts_ptr, idx, bad, segments, LOG)
        # every writer stores the same 1: no atomics needed
        tl.store(bad_ptr + seg, tl.full(idx.shape, 1, tl.int8), mask=bad)


def launch_finite(flat: Tensor, starts: Tensor, out: Tensor) -> Tensor:
    """Flags (int8 view of ``out``) := 1 where a segment of ``flat`` held NaN/Inf, which are
    zeroed in place."""
    n, segments = flat.numel(), starts.numel()
    log = max(1, (segments - 1).bit_length())
    out.zero_()
    _finite_kernel[(triton.cdiv(n, BLOCK),)](flat, starts, out.view(torch.int8), n, segments,
                                             LOG=log, BLOCK=BLOCK, **FP_OPTIONS)
    return out
