# Triton types a kernel's parameters at launch (tl.constexpr marks the compile-time ones)
# mypy: disable-error-code="no-untyped-def"
"""Triton helpers shared by the fused kernels: element tiles, bit packing and unpacking,
the output store, and launch settings.

Importing this module imports Triton and decorates the helpers: with ``TRITON_INTERPRET=1``
in the environment at that moment every kernel of the package runs in Triton's interpreter
(numpy, on CPU tensors), otherwise it is compiled for CUDA. Only
:mod:`hexagram.compress.kernels` imports it, lazily.

Bit layout (that of :func:`hexagram.compress.packing.pack_codes`): code ``i`` of ``b`` bits
occupies bits ``[i * b, (i + 1) * b)`` of a little-endian bit stream, byte ``j`` holding
bits ``[8 j, 8 j + 8)``; the last byte is padded with zero bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["BLOCK", "FP_OPTIONS", "GROUPS", "INTERPRETED", "codes_at", "div_rn", "finite",
           "store_out", "store_packed", "tile"]

#: True when the kernels were decorated for Triton's interpreter (CPU tensors)
INTERPRETED: bool = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else False

#: groups of 8 elements per program of the encoders (2048 elements: one packed byte per
#: group and bit of the code width)
GROUPS = 256

#: elements per program of the decoders and the finiteness check
BLOCK = 2048

#: launch options of every kernel: no contraction of a multiplication and an addition into
#: one fused multiply-add (eager torch rounds after each op; an FMA rounds once and gives
#: other bits)
FP_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def tile(pid, n, GROUPS: tl.constexpr):
    """Program ``pid``'s (GROUPS, 8) tile of element indices (int64), its group indices
    (GROUPS,) and the mask of indices below ``n``."""
    g = pid.to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    idx = g[:, None] * 8 + tl.arange(0, 8)[None, :]
    return idx, g, idx < n


@triton.jit
def finite(v):
    """True where ``v`` is neither NaN nor infinite."""
    return tl.abs(v) < float("inf")


@triton.jit
def div_rn(a, b):
    """``a / b`` rounded to nearest, as IEEE (and torch) divide: ``/`` on float32 compiles
    to an approximate ``div.full.f32`` on NVIDIA (float64 divides exactly either way)."""
    if a.dtype == tl.float32:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def store_packed(out_ptr, codes, g, mask, nbytes, BITS: tl.constexpr):
    """Stores the (GROUPS, 8) int32 ``codes`` (each below ``2**BITS``; masked-off elements
    become zero codes) packed: the 8 codes of group ``g`` form one ``8 * BITS``-bit word,
    code ``k`` at bit ``k * BITS``, stored as the ``BITS`` bytes ``g * BITS ...``, lowest
    first; bytes at or past ``nbytes`` are not written."""
    codes = tl.where(mask, codes, 0)
    if BITS == 8:
        pos = g[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(out_ptr + pos, codes.to(tl.uint8), mask=pos < nbytes)
    else:
        k = tl.arange(0, 8).to(tl.int64)
        word = tl.sum(codes.to(tl.int64) << (k[None, :] * BITS), axis=1)  # fields disjoint
        byte = (word[:, None] >> (k[None, :] * 8)) & 255
        pos = g[:, None] * BITS + k[None, :]
        tl.store(out_ptr + pos, byte.to(tl.uint8), mask=(k[None, :] < BITS) & (pos < nbytes))


@triton.jit
def codes_at(packed_ptr, idx, mask, nbytes, BITS: tl.constexpr):
    """The int32 codes of elements ``idx`` (int64) in a packed stream of ``nbytes`` bytes
    (0 where ``mask`` is off); a code of 3, 5, 6 or 7 bits may straddle two bytes."""
    if BITS == 8:
        return tl.load(packed_ptr + idx, mask=mask, other=0).to(tl.int32)
    bit = idx * BITS
    byte = bit >> 3
    shift = (bit & 7).to(tl.int32)
    low = tl.load(packed_ptr + byte, mask=mask, other=0).to(tl.int32)
    if 8 % BITS == 0:  # 1, 2, 4 bits: a code never leaves its byte
        return (low >> shift) & ((1 << BITS) - 1)
    high = tl.load(packed_ptr + byte + 1, mask=mask & (byte + 1 < nbytes), other=0).to(tl.int32)
    return ((low | (high << 8)) >> shift) & ((1 << BITS) - 1)


@triton.jit
def store_out(out_ptr, idx, mask, v, ADD: tl.constexpr, HALF: tl.constexpr):
    """``out[idx] = v`` (``ADD``: ``out[idx] += v``) as eager torch computes it: ``v``
    rounded to ``out``'s dtype first (through float32 when ``out`` is a 16-bit float
    (``HALF``), as torch converts float64), and 16-bit sums taken in float32."""
    out_t = out_ptr.dtype.element_ty
    if HALF:
        v = v.to(tl.float32)
    v = v.to(out_t)
    if ADD:
        old = tl.load(out_ptr + idx, mask=mask, other=0)
        if HALF:
            v = (old.to(tl.float32) + v.to(tl.float32)).to(out_t)
        else:
            v = old + v
    tl.store(out_ptr + idx, v, mask=mask)
