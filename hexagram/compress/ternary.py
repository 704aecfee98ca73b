"""``terngrad`` (Wen et al. 2017): ternary gradients ``{-s, 0, s}``, stochastic and unbiased,
one max-based scale per tensor (``s = max |x|`` after clipping to ``clip * std``).

Wire format (``n`` elements, ``h`` = 4 bytes, 8 for float64 inputs): the scale (1,) h +
2-bit codes packed four to a byte: ``ceil(n / 4) + h`` bytes.

Example:
    >>> import torch
    >>> c = TernGradCompressor()
    >>> c.compress(torch.randn(1000), torch.Generator().manual_seed(0)).nbytes
    254
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hexagram.compress.base import (
    Aggregation,
    Layout,
    Payload,
    SeededCompressor,
    check_compressible,
    ensure_finite,
)
from hexagram.compress.chunks import TableCodedCompressor, work_dtype
from hexagram.compress.codes import stochastic_codes
from hexagram.compress.packing import cpu_fast, packed_nbytes, unpack_codes
from hexagram.compress.quantize_segments import check_segments, merge_parts
from hexagram.compress.segments import Segments
from hexagram.compress.sign_segments import decode_tables
from hexagram.config import check_float, check_int

__all__ = ["TernGradCompressor", "TernGradConfig"]


def _flat(tensor: Tensor) -> Tensor:
    return tensor.detach().reshape(-1)


@dataclass(frozen=True, kw_only=True)
class TernGradConfig:
    """Settings of ``terngrad``.

    Attributes:
        clip: c, clip ``|x|`` to ``c * std(x)`` before ternarizing (the paper's gradient
            clipping, c = 2.5 there); 0 turns clipping off. Smaller (nonzero) => smaller
            scale and variance, more bias (clipped values lose magnitude).
        seed: seed of the compressor's own generator (used when none is passed).
    """

    clip: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_float(self, "clip", low=0.0)
        check_int(self, "seed", low=0)


def _tables(header: Tensor, dtype: torch.dtype) -> Tensor:
    """(S, 4) ``(code - 1) * scale`` of each scale in ``header`` (S,), cast to ``dtype``."""
    codes = torch.arange(4, dtype=header.dtype, device=header.device) - 1
    return (codes * header[:, None]).to(dtype)


def _std(flat: Tensor, wd: torch.dtype) -> float:
    """Population standard deviation, from the mean and the L2 norm (two reading passes,
    8x cheaper than ``Tensor.std``'s); ``Tensor.std`` where that could lose precision
    (the mean dominates: cancellation) or the squares over/underflow."""
    n = flat.numel()
    mean = float(flat.sum(dtype=wd)) / n
    square = float(torch.linalg.vector_norm(flat, dtype=wd)) ** 2 / n
    if math.isfinite(square) and square > 0 and mean * mean <= 0.5 * square:
        return math.sqrt(square - mean * mean)  # error at most ~2x the rounding of square
    return float(flat.to(wd).std(correction=0))


def _segment_std(flat: Tensor, segments: Segments, wd: torch.dtype) -> Tensor:
    """(len(segments),) float64: each segment's population standard deviation (what
    ``Tensor.std(correction=0)`` gives per tensor), from a per-segment mean and the sum of
    squared deviations from it (two passes, no cancellation), a fixed number of kernels
    whatever the number of segments and no host read."""
    index = segments.index(flat.device)
    lengths = segments.device_lengths(flat.device).to(wd)
    x = flat if flat.dtype == wd else flat.to(wd)
    mean = torch.zeros(len(segments), dtype=wd, device=flat.device).index_add_(0, index, x)
    mean.div_(lengths)
    dev = x - mean.index_select(0, index)
    square = torch.zeros_like(mean).index_add_(0, index, dev.mul_(dev))
    return square.div_(lengths).sqrt_().double()


class TernGradCompressor(TableCodedCompressor, SeededCompressor):
    """TernGrad: ``x -> scale * sign(x) * Bernoulli(|x| / scale)``, ``scale = max|x|``.

    Wire format: header (1,) [scale] (4 bytes, 8 for float64) + 2-bit codes
    (``ceil(n / 4)`` bytes). Unbiased without clipping; with ``clip`` the scale is
    ``min(max|x|, clip * std(x))`` and larger entries become ``+-scale``.
    """

    name = "terngrad"
    #: the min and max, the codes (a read and a draw per element), the decode (an element
    #: written); ``clip`` adds one read for the standard deviation
    memory_passes = 3.25
    aggregation = Aggregation.GATHER

    def __init__(self, config: TernGradConfig | None = None) -> None:
        self.config = config or TernGradConfig()
        super().__init__(self.config.seed)
        self.unbiased = self.config.clip == 0

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        """(1,) scale; 2-bit codes, packed."""
        return (((1,), work_dtype(dtype)), ((packed_nbytes(math.prod(shape), 2),), torch.uint8))

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        check_compressible(tensor, self.name)
        flat, wd = _flat(tensor), work_dtype(tensor.dtype)
        lo, hi = torch.aminmax(flat)
        if self.checks_finite:
            ensure_finite(flat, torch.stack([lo, hi]), self.name)
        gen = self.generator_for(tensor, generator)
        if not cpu_fast(flat):
            return self._compress_on_device(tensor, flat, lo, hi, gen)
        peak = max(-float(lo), float(hi))
        if self.config.clip:
            peak = min(peak, self.config.clip * _std(flat, wd))
        inv = 1 / peak if peak > 0 else 0.0
        # 1 / peak overflows float32 for subnormal peaks: scale in float64 then
        calc = wd if inv <= torch.finfo(wd).max else torch.float64
        scale = torch.tensor([inv], dtype=calc, device=flat.device)
        codes = stochastic_codes(flat, flat.numel(), scale, 1, gen)
        header = torch.tensor([peak], dtype=wd, device=flat.device)
        return Payload(tensors=(header, codes), shape=tensor.shape, dtype=tensor.dtype)

    def _compress_on_device(self, tensor: Tensor, flat: Tensor, lo: Tensor, hi: Tensor,
                            gen: torch.Generator) -> Payload:
        """:meth:`compress` with the scale kept on the device (float64 as the CPU's Python
        floats; the clip's std from ``Tensor.std``); a NaN/Inf input gives a NaN/Inf
        header, so every decoded value is NaN."""
        wd = work_dtype(tensor.dtype)
        peak = torch.maximum(-lo, hi).double()
        if self.config.clip:
            std = (flat if flat.dtype == wd else flat.to(wd)).std(correction=0)
            peak = torch.minimum(peak, self.config.clip * std.double())
        inv = torch.where(peak > 0, 1 / peak, 0.0)
        pre = torch.where(inv > torch.finfo(wd).max, 2.0**64, 1.0)  # subnormal peaks
        codes = stochastic_codes(flat, flat.numel(), (inv / pre).to(wd).reshape(1), 1, gen,
                                 pre.to(wd).reshape(1))
        return Payload(tensors=(peak.to(wd).reshape(1), codes), shape=tensor.shape,
                       dtype=tensor.dtype)

    def code_table(self, payload: Payload) -> tuple[int, Tensor, Tensor] | None:
        """``(code - 1) * scale`` (exact: +-scale and 0); None for a bucket's payload (a
        scale per segment)."""
        if "segments" in payload.meta:
            return None
        header, codes = payload.tensors
        return 2, _tables(header, payload.dtype).reshape(-1), codes

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor:
        if "segments" in payload.meta:
            return self.decompress_segments_into(payload, out, add)
        return super().decompress_into(payload, out, add)

    def compress_segments(self, flat: Tensor, segments: Segments,
                          generator: torch.Generator | None = None) -> Payload:
        """Each segment's scale (``_foreach_norm``, max |x|; with ``clip``, at most ``clip``
        times the segment's standard deviation, :func:`_segment_std`), the codes of the
        whole buffer drawn at once."""
        flat = check_segments(flat, segments, self.name)
        gen = self.generator_for(flat, generator)
        wd = work_dtype(flat.dtype)
        peak = torch.stack(torch._foreach_norm(flat.split(segments.lengths), math.inf))
        if self.checks_finite:
            ensure_finite(flat, peak, self.name)
        peak = peak.double()
        if self.config.clip:
            peak = torch.minimum(peak, self.config.clip * _segment_std(flat, segments, wd))
        inv = torch.where(peak > 0, 1 / peak, 0.0)
        index = segments.index(flat.device)
        if not cpu_fast(flat):  # subnormal peaks: x * 2**64 first
            pre = torch.where(inv > torch.finfo(wd).max, 2.0**64, 1.0)
            codes = stochastic_codes(flat, 1, (inv / pre).to(wd).index_select(0, index), 1,
                                     gen, pre.to(wd).index_select(0, index))
        elif bool((inv <= torch.finfo(wd).max).all()):
            codes = stochastic_codes(flat, 1, inv.to(wd).index_select(0, index), 1, gen)
        else:  # the CPU scales those tensors in float64
            return merge_parts([self.compress(v, gen) for v in segments.views(flat)], 2,
                               flat, segments)
        return Payload(tensors=(peak.to(wd), codes), shape=torch.Size([segments.numel]),
                       dtype=flat.dtype, meta={"segments": segments})

    def decompress_segments_into(self, payload: Payload, out: Tensor,
                                 add: bool = False) -> Tensor:
        if "parts" in payload.meta:  # compressed segment by segment (clip)
            return super().decompress_segments_into(payload, out, add)
        segments: Segments = payload.meta["segments"]
        header, packed = payload.tensors
        codes = unpack_codes(packed, 2, segments.numel)
        return decode_tables(_tables(header, out.dtype), codes, 2, segments, out, add)

    def __repr__(self) -> str:
        return f"TernGradCompressor({self.config})"
