"""Quantizers: ``minmax8`` (BAGUA's ByteGrad) and its 4-bit form ``minmax4``, ``qsgd``
(Alistarh et al. 2017); ``terngrad`` (Wen et al. 2017; per-tensor scale) lives in
:mod:`hexagram.compress.ternary` (importable from here too).

``minmax8`` and ``qsgd`` cut the flat tensor into chunks of a configured size, each with
its own scale, so the payload layout depends only on ``numel``: they are
``Aggregation.SCATTER_GATHER`` compressors (a rank's chunk can be decompressed, reduced and
recompressed on its own).

Wire formats (``n`` elements, chunks of ``c``, ``G = ceil(n / c)``, ``h`` = 4 bytes, 8 for
float64 inputs):

- ``minmax8``: header (G, 2) [min, step] + n uint8 codes: ``n + 2*h*G`` bytes.
  ``x ~ min + code * step`` with ``step = (max - min) / 255``, rounding to nearest
  (error <= step / 2 per element, plus < 1e-3 step of float rounding; deterministic,
  biased).
- ``minmax4``: the same with 4-bit codes packed two to a byte and 15 steps per chunk
  (``step = (max - min) / 15``; default chunk 128): ``ceil(n / 2) + 2*h*G`` bytes.
- ``qsgd``: header (G,) L2 norms + codes of ``b = ceil(log2(2s + 1))`` bits, bit-packed:
  ``ceil(n * b / 8) + h*G`` bytes. ``x ~ norm * l / s`` with ``l`` in ``[-s, s]`` the
  stochastic rounding of ``s * x / norm`` (unbiased; the variance of a chunk is at most
  ``min(c/s^2, sqrt(c)/s) * ||chunk||^2``, so at most ``min(n/s^2, sqrt(n)/s) * ||x||^2``).
  The dither comes from 16 random bits per element: the rounding bias is at most
  ``2**-17`` of a level.

Example:
    >>> import torch
    >>> from hexagram.compress.quantize import MinMax8Compressor
    >>> c = MinMax8Compressor()
    >>> p = c.compress(torch.linspace(-1, 1, 2048))
    >>> p.nbytes, float((c.decompress(p) - torch.linspace(-1, 1, 2048)).abs().max()) < 0.004
    (2064, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hexagram.compress import kernels
from hexagram.compress.base import (
    Aggregation,
    Compressor,
    Layout,
    Payload,
    SeededCompressor,
    check_compressible,
    decompress_via_into,
    ensure_finite,
)
from hexagram.compress.chunks import (
    affine_rows,
    chunk_reduce,
    decode_affine,
    decode_table,
    fma_rows,
    halves,
    work_dtype,
)
from hexagram.compress.codes import random_words, stochastic_codes, truncate_to
from hexagram.compress.faults import any_of, beyond
from hexagram.compress.packing import block_size, cpu_fast, encode_blocks, packed_nbytes
from hexagram.compress.quantize_segments import (
    check_segments,
    chunk_norms,
    minmax_decode,
    minmax_encode,
    qsgd_decode,
    qsgd_encode,
)
from hexagram.compress.segments import Segments
from hexagram.compress.ternary import TernGradCompressor, TernGradConfig
from hexagram.config import check_int

__all__ = [
    "MinMax4Compressor",
    "MinMax4Config",
    "MinMax8Compressor",
    "MinMax8Config",
    "QSGDCompressor",
    "QSGDConfig",
    "TernGradCompressor",
    "TernGradConfig",
    "random_words",
    "stochastic_codes",
]


@dataclass(frozen=True, kw_only=True)
class MinMax8Config:
    """Settings of ``minmax8``.

    Attributes:
        chunk_size: elements sharing one (min, step) pair. Smaller => smaller error
            (range of a chunk / 510), more header bytes (8 per chunk).
    """

    chunk_size: int = 1024

    def __post_init__(self) -> None:
        check_int(self, "chunk_size", low=1, high=1 << 24)


@dataclass(frozen=True, kw_only=True)
class MinMax4Config(MinMax8Config):
    """Settings of ``minmax4``.

    Attributes:
        chunk_size: elements sharing one (min, step) pair. Smaller => smaller error
            (range of a chunk / 30), more header bytes (8 per chunk: 0.5 bit per element
            at the default 128).
    """

    chunk_size: int = 128


@dataclass(frozen=True, kw_only=True)
class QSGDConfig:
    """Settings of ``qsgd``.

    Attributes:
        levels: s, quantization levels per sign. More => lower variance, more bits
            (ceil(log2(2s + 1)): 1 -> 2 bits, 7 -> 4 bits, 127 -> 8 bits).
        bucket_size: elements sharing one norm. Smaller => lower variance, more header
            bytes (4 per bucket).
        seed: seed of the compressor's own generator (used when none is passed).
    """

    levels: int = 7
    bucket_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        check_int(self, "levels", low=1, high=127)
        check_int(self, "bucket_size", low=1, high=1 << 24)
        check_int(self, "seed", low=0)


def _flat(tensor: Tensor) -> Tensor:
    return tensor.detach().reshape(-1)


def _check_header(payload: Payload, chunk: int, who: str) -> int:
    """Number of elements, after checking the header matches this compressor's chunks."""
    n = payload.shape.numel()
    rows = -(-n // chunk)
    if payload.tensors[0].shape[0] != rows:
        raise ValueError(f"{who}: payload has {payload.tensors[0].shape[0]} chunk headers, "
                         f"expected {rows} for {n} elements; was it compressed with another "
                         "chunk size?")
    return n


class MinMax8Compressor(Compressor):
    """8-bit min-max quantization per chunk (BAGUA ByteGrad). See the module docstring."""

    name = "minmax8"
    aggregation = Aggregation.SCATTER_GATHER
    unbiased = False
    #: bits per code; ``2**bits - 1`` steps between a chunk's min and max
    bits = 8
    #: the chunks' min and max, the codes (a read, a byte written), the decode (a byte
    #: read, an element written)
    memory_passes = 3.5

    def __init__(self, config: MinMax8Config | None = None) -> None:
        self.config = config or MinMax8Config()

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        """(G, 2) header (min, step), G = ceil(n / chunk_size); the ``bits``-bit codes, packed
        (``n`` bytes at 8 bits, ``ceil(n / 2)`` at 4)."""
        n = math.prod(shape)
        return (((-(-n // self.config.chunk_size), 2), work_dtype(dtype)),
                ((packed_nbytes(n, self.bits),), torch.uint8))

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        check_compressible(tensor, self.name)
        flat, c, wd = _flat(tensor), self.config.chunk_size, work_dtype(tensor.dtype)
        if not cpu_fast(flat) and kernels.dispatch(flat):  # header and codes: two kernels
            header, codes = kernels.minmax_encode(flat, c, self.bits)
            if self.checks_finite:  # NaN/Inf make their chunk's header row non-finite
                ensure_finite(flat, header, self.name)
            return Payload(tensors=(header, codes), shape=tensor.shape, dtype=tensor.dtype)
        # amin and amax: 17x faster than aminmax(dim=1), which is not vectorized on CPU
        ext = chunk_reduce(flat, c, lambda r: torch.stack([r.amin(1), r.amax(1)], 1)).to(wd)
        if self.checks_finite:  # NaN/Inf make a chunk's min or max non-finite
            ensure_finite(flat, ext, self.name)
        lo, hi = ext[:, 0], ext[:, 1]
        # (hi - lo) / (2**bits - 1) without overflowing
        step = (hi / 2 - lo / 2) / (((1 << self.bits) - 1) / 2)
        codes = _minmax_codes(flat, c, lo, hi, step, self.bits)
        return Payload(tensors=(torch.stack([lo, step], 1), codes), shape=tensor.shape,
                       dtype=tensor.dtype)

    def decompress(self, payload: Payload) -> Tensor:
        return decompress_via_into(self, payload)

    def compress_segments(self, flat: Tensor, segments: Segments,
                          generator: torch.Generator | None = None) -> Payload:
        """Every segment's chunks in one pass (:mod:`hexagram.compress.quantize_segments`)."""
        return minmax_encode(self, check_segments(flat, segments, self.name), segments)

    def decompress_segments_into(self, payload: Payload, out: Tensor,
                                 add: bool = False) -> Tensor:
        return minmax_decode(self, payload, out, add)

    def payload_fault(self, payload: Payload) -> Tensor:
        """A chunk's min or step NaN/Inf, a negative step, or its top code decoding past
        the dtype's range (codes are in range by construction: every ``bits``-bit code
        is a step of the chunk). Per tensor and per bucket alike (one header row per
        chunk)."""
        if "parts" in payload.meta:
            return super().payload_fault(payload)
        header = payload.tensors[0].double()
        lo, step = header[:, 0], header[:, 1]
        top = torch.add(lo, step, alpha=(1 << self.bits) - 1)  # the top code's value
        return any_of([beyond(torch.stack([lo, top]), payload.dtype), (step < 0).any()])

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor:
        if "segments" in payload.meta:
            return minmax_decode(self, payload, out, add)
        c = self.config.chunk_size
        n = _check_header(payload, c, self.name)
        header, codes = payload.tensors
        lo, step = header[:, 0], header[:, 1]
        top = (1 << self.bits) - 1
        if not cpu_fast(codes):  # chunks spanning beyond the range decode in halves
            factor, post = halves(~torch.isfinite(step * top), step.dtype)
            return decode_affine(codes, self.bits, n, c, step * factor, lo * factor,
                                 payload.dtype, out, add, post=post)
        if not bool(torch.isfinite(step * top).all()):  # a chunk spans beyond the range
            lo, step = lo.double(), step.double()
        return decode_affine(codes, self.bits, n, c, step, lo, payload.dtype, out, add)


class MinMax4Compressor(MinMax8Compressor):
    """4-bit min-max quantization per chunk: ``minmax8``'s format with 15 steps per chunk
    (codes packed two to a byte). Deterministic, so a scatter-gather sum (decoded and summed
    in float32) gives every rank the same bits; see the module docstring."""

    name = "minmax4"
    bits = 4
    memory_passes = 3.25  # minmax8's passes, half a byte per code

    def __init__(self, config: MinMax8Config | None = None) -> None:
        super().__init__(config or MinMax4Config())


def _minmax_codes(flat: Tensor, c: int, lo: Tensor, hi: Tensor, step: Tensor,
                  bits: int = 8) -> Tensor:
    """Packed codes ``trunc((x - lo) / step + 0.5)`` in [0, 2**bits - 1], chunk by chunk."""
    inv = torch.where(step > 0, 1 / step, 0.0)
    inv = torch.where(torch.isfinite(inv), inv, 0.0)  # subnormal step: all codes 0 (= lo)
    if not cpu_fast(flat):
        return _minmax_codes_device(flat, c, lo, hi, inv, bits)
    # x - lo overflows where a chunk spans more than the dtype's range: use float64 then
    calc = torch.float64 if not bool(torch.isfinite(hi - lo).all()) else lo.dtype
    lo_c, inv_c = lo.to(calc), inv.to(calc)
    # Where |x| <= 64 (hi - lo) in every chunk (always, for chunks that straddle 0),
    # x / step + (0.5 - lo / step) in one pass errs by less than 1e-3 of a step; otherwise
    # subtract lo first (exact).
    fused = calc == lo.dtype and bool((torch.maximum(lo.abs(), hi.abs()) <= 64 * (hi - lo))
                                      .all())
    offset = 0.5 - lo_c * inv_c
    block = block_size(flat.device)
    tmp = torch.empty(min(block, flat.numel()), dtype=calc, device=flat.device)
    ints = torch.empty(tmp.numel(), dtype=torch.int32, device=flat.device)

    def fill(start: int, stop: int, codes: Tensor) -> None:
        buf = tmp[: stop - start]
        if fused:
            fma_rows(buf, flat[start:stop], start, c, inv_c, offset)
        else:
            buf.copy_(flat[start:stop])
            affine_rows(buf, start, c, sub=lo_c, mul=inv_c)
            buf.add_(0.5)
        truncate_to(codes, buf, ints)

    return encode_blocks(flat.numel(), bits, fill, flat.device, block)


def _minmax_codes_device(flat: Tensor, c: int, lo: Tensor, hi: Tensor, inv: Tensor,
                         bits: int = 8) -> Tensor:
    """:func:`_minmax_codes` without reading the device: always the exact form
    ``(x - lo) * inv + 0.5`` (the CPU's fused form, chosen by a read, may differ by one
    code within 1e-3 of a step of a rounding boundary), in halves where a chunk's range
    overflows (the CPU computes those in float64; the codes agree but at such boundaries)."""
    factor, _ = halves(~torch.isfinite(hi - lo), lo.dtype)
    sub, mul = lo * factor, inv / factor
    block = block_size(flat.device)
    tmp = torch.empty(min(block, flat.numel()), dtype=lo.dtype, device=flat.device)
    ints = torch.empty(tmp.numel(), dtype=torch.int32, device=flat.device)

    def fill(start: int, stop: int, codes: Tensor) -> None:
        buf = tmp[: stop - start]
        fma_rows(buf, flat[start:stop], start, c, factor, None)  # x (exact), or x / 2
        affine_rows(buf, start, c, sub=sub, mul=mul)
        truncate_to(codes, buf.add_(0.5), ints)

    return encode_blocks(flat.numel(), bits, fill, flat.device, block)


class QSGDCompressor(SeededCompressor):
    """QSGD: stochastic rounding to ``s`` levels of ``|x| / norm`` per bucket (unbiased)."""

    name = "qsgd"
    aggregation = Aggregation.SCATTER_GATHER
    unbiased = True
    #: the bucket norms, the codes (a read and a draw per element, blocks of draws kept in
    #: cache; at most a byte written), the decode (at most a byte read, an element written)
    memory_passes = 3.5

    def __init__(self, config: QSGDConfig | None = None) -> None:
        self.config = config or QSGDConfig()
        super().__init__(self.config.seed)
        self.bits = (2 * self.config.levels).bit_length()  # ceil(log2(2s + 1))

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        """(G,) norms, G = ceil(n / bucket_size); the ``bits``-bit codes, packed."""
        n = math.prod(shape)
        return (((-(-n // self.config.bucket_size),), work_dtype(dtype)),
                ((packed_nbytes(n, self.bits),), torch.uint8))

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        check_compressible(tensor, self.name)
        flat, d, wd = _flat(tensor), self.config.bucket_size, work_dtype(tensor.dtype)
        s = self.config.levels
        # the last bucket padded with zeros: the norms of compress_segments' padded rows
        norms = chunk_norms(flat, d, wd, self.name, check=self.checks_finite)
        # an unchecked Inf norm (values too large for wd) decodes to NaN: the caller sees it
        if self.checks_finite and not bool(torch.isfinite(norms).all()):
            raise ValueError(f"{self.name}: a bucket's L2 norm exceeds the {wd} range; "
                             "scale the tensor down (e.g. divide by the world size) first")
        scale = torch.where(norms > 0, s / norms.double(), 0.0)  # (G,) float64
        gen = self.generator_for(tensor, generator)
        if not cpu_fast(flat):  # s / norm beyond wd (subnormal norms): x * 2**64 first
            pre = torch.where(scale > torch.finfo(wd).max, 2.0**64, 1.0)
            codes = stochastic_codes(flat, d, (scale / pre).to(wd), s, gen, pre.to(wd))
            return Payload(tensors=(norms, codes), shape=tensor.shape, dtype=tensor.dtype)
        # s / norm overflows float32 for subnormal norms: compute those tensors in float64
        calc = wd if bool((scale <= torch.finfo(wd).max).all()) else torch.float64
        codes = stochastic_codes(flat, d, scale.to(calc), s, gen)
        return Payload(tensors=(norms, codes), shape=tensor.shape, dtype=tensor.dtype)

    def decompress(self, payload: Payload) -> Tensor:
        return decompress_via_into(self, payload)

    def compress_segments(self, flat: Tensor, segments: Segments,
                          generator: torch.Generator | None = None) -> Payload:
        """Every segment's buckets in one pass: the same norms as :meth:`compress` of each
        segment, the codes drawn for the whole buffer at once."""
        flat = check_segments(flat, segments, self.name)
        return qsgd_encode(self, flat, segments, self.generator_for(flat, generator))

    def decompress_segments_into(self, payload: Payload, out: Tensor,
                                 add: bool = False) -> Tensor:
        return qsgd_decode(self, payload, out, add)

    def payload_fault(self, payload: Payload) -> Tensor:
        """A norm NaN/Inf or negative, or one whose levels decode past the range: the
        largest code (``2**bits - 1``, past ``2s`` when ``2s + 1`` is not a power of two:
        it decodes to a little more than the norm, finite, so codes are not read) times
        ``norm / s`` in the work dtype, the decoded value in the payload's dtype."""
        if "parts" in payload.meta:
            return super().payload_fault(payload)
        norms, s, top = payload.tensors[0], self.config.levels, (1 << self.bits) - 1
        return any_of([beyond(norms, payload.dtype, max(s, top - s) / s),
                       beyond(norms, norms.dtype, top / s), (norms < 0).any()])

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor:
        if "segments" in payload.meta:
            return qsgd_decode(self, payload, out, add)
        d, s = self.config.bucket_size, self.config.levels
        n = _check_header(payload, d, self.name)
        norms, codes = payload.tensors
        if self.bits in (2, 4) and out.dtype == norms.dtype:
            # (code - s) * (norm / s): the levels by table lookup, one multiplication
            levels = torch.arange(-s, (1 << self.bits) - s, dtype=out.dtype,
                                  device=out.device)
            return decode_table(codes, self.bits, n, levels, out, add, d, norms / s)
        # (code - s) * norm / s = code * (norm / s) - norm
        return decode_affine(codes, self.bits, n, d, norms / s, -norms, payload.dtype, out,
                             add)

    def __repr__(self) -> str:
        return f"QSGDCompressor({self.config})"
