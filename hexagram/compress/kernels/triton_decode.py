# Triton types a kernel's parameters at launch (tl.constexpr marks the compile-time ones)
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of the decoders: :func:`hexagram.compress.chunks.decode_table` and
:func:`hexagram.compress.chunks.decode_affine` in one pass each, reading the packed codes
and writing (or adding to) the output once, with the eager code's arithmetic, dtypes and
rounding (equal bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hexagram.compress.kernels.triton_bits import BLOCK, FP_OPTIONS, codes_at, store_out

__all__ = ["launch_affine", "launch_table"]

_HALF = (torch.float16, torch.bfloat16)


@triton.jit
def _table_kernel(packed_ptr, values_ptr, scale_ptr, out_ptr, n, nbytes, chunk,
                  BITS: tl.constexpr, HAS_SCALE: tl.constexpr, ADD: tl.constexpr,
                  HALF: tl.constexpr, BLOCK: tl.constexpr):
    """``out = values[code] [* scale[chunk]]`` (``ADD``: ``+=``), in ``out``'s dtype."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    v = tl.load(values_ptr + codes_at(packed_ptr, idx, m, nbytes, BITS), mask=m, other=0)
    if HAS_SCALE:
        s = tl.load(scale_ptr + idx // chunk, mask=m, other=0)
        if HALF:  # torch multiplies 16-bit floats in float32, then rounds
            v = (v.to(tl.float32) * s.to(tl.float32)).to(out_ptr.dtype.element_ty)
        else:
            v = v * s
    store_out(out_ptr, idx, m, v, ADD, HALF)


def launch_table(packed: Tensor, bits: int, n: int, values: Tensor, out: Tensor, add: bool,
                 chunk: int, scale: Tensor | None) -> Tensor:
    """Table decode into ``out`` (see :func:`hexagram.compress.kernels.decode_table`)."""
    _table_kernel[(triton.cdiv(n, BLOCK),)](
        packed, values, values if scale is None else scale, out, n, packed.numel(),
        max(chunk, 1), BITS=bits, HAS_SCALE=scale is not None, ADD=add,
        HALF=out.dtype in _HALF, BLOCK=BLOCK, **FP_OPTIONS)
    return out


@triton.jit
def _affine_kernel(packed_ptr, scale_ptr, offset_ptr, post_ptr, out_ptr, n, nbytes, chunk,
                   BITS: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_POST: tl.constexpr,
                   ADD: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """``out = (code * scale[c] + offset[c]) * post[c]`` in ``scale``'s dtype, then
    rounded to ``out``'s (``ADD``: added)."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    c = idx // chunk
    v = codes_at(packed_ptr, idx, m, nbytes, BITS).to(scale_ptr.dtype.element_ty)
    v = v * tl.load(scale_ptr + c, mask=m, other=0)
    if HAS_OFFSET:
        v = v + tl.load(offset_ptr + c, mask=m, other=0)
    if HAS_POST:
        v = v * tl.load(post_ptr + c, mask=m, other=1)
    store_out(out_ptr, idx, m, v, ADD, HALF)


def launch_affine(packed: Tensor, bits: int, n: int, chunk: int, scale: Tensor,
                  offset: Tensor | None, out: Tensor, add: bool, post: Tensor | None
                  ) -> Tensor:
    """Affine decode into ``out`` (see :func:`hexagram.compress.kernels.decode_affine`)."""
    _affine_kernel[(triton.cdiv(n, BLOCK),)](
        packed, scale, scale if offset is None else offset, scale if post is None else post,
        out, n, packed.numel(), chunk, BITS=bits, HAS_OFFSET=offset is not None,
        HAS_POST=post is not None, ADD=add, HALF=out.dtype in _HALF, BLOCK=BLOCK,
        **FP_OPTIONS)
    return out
