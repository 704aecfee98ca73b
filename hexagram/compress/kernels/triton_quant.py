# Triton types a kernel's parameters at launch (tl.constexpr marks the compile-time ones)
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of the quantizers' encoders: ``minmax8`` / ``minmax4`` (header and codes)
and the stochastic rounding of ``qsgd`` and ``terngrad``.

Each kernel does, element for element, the arithmetic of the eager code CUDA takes
(:mod:`hexagram.compress.quantize`, :mod:`hexagram.compress.codes` with
:data:`~hexagram.compress.packing.CPU_FAST_PATHS` off) in the same order and dtypes, each
op rounded on its own, so the payloads are equal bit for bit. The launchers here take
checked arguments; :mod:`hexagram.compress.kernels` is the public API.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hexagram.compress.kernels.triton_bits import (
    FP_OPTIONS,
    GROUPS,
    div_rn,
    finite,
    store_packed,
    tile,
)

__all__ = ["launch_minmax", "launch_stochastic"]

#: elements of a (rows, cols) tile of the per-chunk min-max kernel
_TILE = 2048


@triton.jit
def _chunk_extremes(x_ptr, rows, ok, n, chunk, wd: tl.constexpr, ROWS: tl.constexpr,
                    COLS: tl.constexpr):
    """Min and max (in ``wd``; NaN if the chunk holds one, as torch's) of chunks ``rows``."""
    start = rows * chunk
    end = tl.minimum(start + chunk, n)
    cols = tl.arange(0, COLS)
    lo = tl.full([ROWS], float("inf"), wd)
    hi = tl.full([ROWS], float("-inf"), wd)
    nan = tl.zeros([ROWS], tl.int32)
    for t in range(0, tl.cdiv(chunk, COLS)):
        idx = start[:, None] + t * COLS + cols[None, :]
        m = ok[:, None] & (idx < end[:, None])
        x = tl.load(x_ptr + idx, mask=m, other=0).to(wd)
        lo = tl.minimum(lo, tl.min(tl.where(m, x, float("inf")), 1))
        hi = tl.maximum(hi, tl.max(tl.where(m, x, float("-inf")), 1))
        # min and max may skip NaN on the device: track it apart
        nan = tl.maximum(nan, tl.max((m & (x != x)).to(tl.int32), 1))
    return tl.where(nan > 0, float("nan"), lo), tl.where(nan > 0, float("nan"), hi)


@triton.jit
def _minmax_header_kernel(x_ptr, header_ptr, aux_ptr, n, chunk, groups,
                          HALF_TOP: tl.constexpr, RECIP: tl.constexpr, ROWS: tl.constexpr,
                          COLS: tl.constexpr):
    """Per chunk: header ``[lo, step]`` and ``aux`` ``[factor, sub, mul]`` of the codes."""
    wd = header_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = rows < groups
    lo, hi = _chunk_extremes(x_ptr, rows, ok, n, chunk, wd, ROWS, COLS)
    # (hi / 2 - lo / 2) / HALF_TOP; torch divides by a Python number as a multiplication
    # by its reciprocal on CUDA (RECIP), as a true division on the CPU
    span = hi * 0.5 - lo * 0.5
    div = tl.full([ROWS], HALF_TOP, wd)
    if RECIP:
        step = span * div_rn(tl.full([ROWS], 1.0, wd), div)
    else:
        step = div_rn(span, div)
    one = tl.full([ROWS], 1.0, wd)
    # 1 / step where step > 0 (elsewhere 0; the division by 1 there is never used)
    inv = div_rn(one, tl.where(step > 0, step, one))
    inv = tl.where(step > 0, inv, 0.0)
    inv = tl.where(finite(inv), inv, 0.0)  # subnormal step: every code 0 (= lo)
    factor = tl.where(finite(hi - lo), one, 0.5)  # a range beyond the dtype: halves
    tl.store(header_ptr + rows * 2, lo, mask=ok)
    tl.store(header_ptr + rows * 2 + 1, step, mask=ok)
    tl.store(aux_ptr + rows * 3, factor, mask=ok)
    tl.store(aux_ptr + rows * 3 + 1, lo * factor, mask=ok)
    tl.store(aux_ptr + rows * 3 + 2, div_rn(inv, factor), mask=ok)


@triton.jit
def _minmax_codes_kernel(x_ptr, aux_ptr, out_ptr, n, nbytes, chunk, BITS: tl.constexpr,
                         STORE: tl.constexpr, GROUPS: tl.constexpr):
    """Codes ``trunc((x * factor - sub) * mul + 0.5)`` of each chunk's aux, ``BITS`` wide,
    stored packed ``STORE`` bits each (8: one per byte)."""
    wd = aux_ptr.dtype.element_ty
    idx, g, m = tile(tl.program_id(0), n, GROUPS)
    c = idx // chunk
    factor = tl.load(aux_ptr + c * 3, mask=m, other=1.0)
    sub = tl.load(aux_ptr + c * 3 + 1, mask=m, other=0.0)
    mul = tl.load(aux_ptr + c * 3 + 2, mask=m, other=0.0)
    t = tl.load(x_ptr + idx, mask=m, other=0).to(wd) * factor
    t = (t - sub) * mul
    t = t + 0.5
    codes = t.to(tl.int32) & 255  # int32, then its low byte (torch's uint8 copy)
    store_packed(out_ptr, codes & ((1 << BITS) - 1), g, m, nbytes, STORE)


def launch_minmax(flat: Tensor, chunk: int, bits: int, recip: bool, store: int | None = None
                  ) -> tuple[Tensor, Tensor]:
    """(header (G, 2) [lo, step] in the work dtype, codes packed ``store`` (default
    ``bits``) bits each) of ``flat``."""
    n = flat.numel()
    groups = -(-n // chunk)
    wd = torch.float64 if flat.dtype == torch.float64 else torch.float32
    header = torch.empty(groups, 2, dtype=wd, device=flat.device)
    aux = torch.empty(groups, 3, dtype=wd, device=flat.device)
    cols = min(triton.next_power_of_2(chunk), _TILE)
    rows = _TILE // cols
    _minmax_header_kernel[(triton.cdiv(groups, rows),)](
        flat, header, aux, n, chunk, groups, HALF_TOP=((1 << bits) - 1) / 2, RECIP=recip,
        ROWS=rows, COLS=cols, **FP_OPTIONS)
    store = bits if store is None else store
    nbytes = (n * store + 7) // 8
    codes = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    _minmax_codes_kernel[(triton.cdiv(n, 8 * GROUPS),)](
        flat, aux, codes, n, nbytes, chunk, BITS=bits, STORE=store, GROUPS=GROUPS,
        **FP_OPTIONS)
    return header, codes


@triton.jit
def _stochastic_kernel(x_ptr, scale_ptr, pre_ptr, dither_ptr, out_ptr, n, nbytes, chunk,
                       LEVELS: tl.constexpr, SHIFT: tl.constexpr, HAS_PRE: tl.constexpr,
                       BITS: tl.constexpr, GROUPS: tl.constexpr):
    """Packed codes ``clamp(x [* pre] * scale + (s + 0.5 + 2**-17) + r / 2**16, 0, 2 s)``
    truncated, ``r`` the element's int16 dither."""
    cd = scale_ptr.dtype.element_ty
    idx, g, m = tile(tl.program_id(0), n, GROUPS)
    c = idx // chunk
    t = tl.load(x_ptr + idx, mask=m, other=0).to(cd)
    if HAS_PRE:
        t = t * tl.load(pre_ptr + c, mask=m, other=1.0)
    t = t * tl.load(scale_ptr + c, mask=m, other=0.0)
    t = t + tl.full([1], SHIFT, cd)  # s + 0.5 + 2**-17: exact in float32
    dither = tl.load(dither_ptr + idx, mask=m, other=0).to(cd)
    t = t + dither * 0.0000152587890625  # r / 2**16: exact
    t = tl.minimum(tl.maximum(t, 0.0), 2.0 * LEVELS)
    codes = t.to(tl.int32) & 255
    store_packed(out_ptr, codes & ((1 << BITS) - 1), g, m, nbytes, BITS)


def launch_stochastic(flat: Tensor, chunk: int, scale: Tensor, levels: int, dither: Tensor,
                      pre: Tensor | None, store: int | None = None) -> Tensor:
    """Stochastic codes of ``flat`` packed ``store`` bits each (default
    ``(2 levels).bit_length()``; 8: one per byte; every code is below ``2 levels + 1``)."""
    n = flat.numel()
    bits = (2 * levels).bit_length() if store is None else store
    nbytes = (n * bits + 7) // 8
    codes = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    _stochastic_kernel[(triton.cdiv(n, 8 * GROUPS),)](
        flat, scale, scale if pre is None else pre, dither, codes, n, nbytes, chunk,
        LEVELS=levels, SHIFT=levels + 0.5 + 2.0**-17, HAS_PRE=pre is not None, BITS=bits,
        GROUPS=GROUPS, **FP_OPTIONS)
    return codes
