"""Sparsifiers: ``topk`` (exact or DGC-style approximate), ``randomk`` and ``threshold``.

Each sends (value, index) pairs; indices are int32 (int64 for tensors of 2**31 elements or
more), values keep the input's dtype. All are ``Aggregation.GATHER``: different ranks keep
different indices, so payloads are gathered and added after decompression. Payload shapes
depend only on ``numel`` and the config:

- ``topk``: ``k = config.k`` or ``ceil(density * n)``; values (k,) + indices (k,), the
  indices ascending: ``k * (itemsize + 4)`` bytes. ``approximate=True`` estimates the
  magnitude threshold from a random sample (as DGC does), keeps the candidates above it
  block by block and takes the exact top-k among them; if the sample overestimated the
  threshold (fewer than k candidates) it falls back to the exact ``torch.topk``. The
  result is the exact top-k (up to ties) either way; only the time differs.
- ``randomk``: k distinct indices by stratified sampling: the tensor is cut into k strata
  of ``floor(n/k)`` or ``ceil(n/k)`` elements and one uniform index is drawn in each (O(k),
  no permutation of n). With ``rescale`` the decoded value is multiplied by the stratum
  size (the inverse inclusion probability), so the estimate is unbiased.
- ``threshold``: every entry with ``|x| >= threshold``; the count is data-dependent, so the
  payload has a fixed capacity ``c = ceil(max_density * n)``: count (1,) int32 + values (c,)
  + indices (c,), ``4 + c * (itemsize + 4)`` bytes. Slots after ``count`` hold value 0 at
  index 0; if more than ``c`` entries pass, the ``c`` largest are sent.

Example:
    >>> import torch
    >>> from hexagram.compress.sparsify import TopKCompressor, TopKConfig
    >>> c = TopKCompressor(TopKConfig(k=2))
    >>> c.decompress(c.compress(torch.tensor([0.1, -3.0, 2.0, 0.5]))).tolist()
    [0.0, -3.0, 2.0, 0.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hexagram.compress import sparse_segments as seg_ops
from hexagram.compress.base import (
    Aggregation,
    Layout,
    Payload,
    SeededCompressor,
    check_compressible,
    decompress_via_into,
    ensure_finite,
)
from hexagram.compress.chunks import work_dtype
from hexagram.compress.faults import any_of, beyond
from hexagram.compress.packing import BLOCK, cpu_fast
from hexagram.compress.segments import Segments
from hexagram.compress.sparse_select import (
    above,
    ascending,
    index_dtype,
    largest,
    pairs_fault,
    pairs_layout,
    scatter,
)
from hexagram.compress.threshold import ThresholdCompressor, ThresholdConfig
from hexagram.config import check_float, check_int

__all__ = [
    "KeepConfig",
    "RandomKCompressor",
    "RandomKConfig",
    "ThresholdCompressor",
    "ThresholdConfig",
    "TopKCompressor",
    "TopKConfig",
    "above",
]


@dataclass(frozen=True, kw_only=True)
class KeepConfig:
    """How many elements a sparsifier keeps (base of ``topk``'s and ``randomk``'s settings).

    Attributes:
        density: fraction of elements kept, k = ceil(density * n). Lower => fewer bytes,
            larger error.
        k: exact number of elements kept; overrides ``density`` when > 0 (a tensor with
            fewer than k elements is an error).
        seed: seed of the compressor's own generator (used when none is passed).
    """

    density: float = 0.01
    k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        check_float(self, "density", low=0.0, high=1.0, low_open=True)
        check_int(self, "k", low=0)
        check_int(self, "seed", low=0)

    def count(self, n: int) -> int:
        """Elements kept out of ``n``."""
        if self.k > n:
            raise ValueError(f"{type(self).__name__}.k={self.k} is larger than the tensor "
                             f"({n} elements); lower k or use density")
        return self.k or min(n, max(1, math.ceil(self.density * n)))


@dataclass(frozen=True, kw_only=True)
class RandomKConfig(KeepConfig):
    """Settings of ``randomk`` (``density``, ``k``, ``seed`` as in :class:`KeepConfig`).

    Attributes:
        rescale: multiply kept values by the inverse inclusion probability (unbiased,
            higher variance); turn it off under error feedback.
    """

    rescale: bool = True


@dataclass(frozen=True, kw_only=True)
class TopKConfig(KeepConfig):
    """Settings of ``topk`` (``density``, ``k``, ``seed`` as in :class:`KeepConfig`).

    Attributes:
        approximate: estimate the threshold from a sample (DGC); much faster on large
            CPU tensors, same selection unless it must fall back to the exact top-k. On
            CUDA the exact ``torch.topk`` (a radix select) is used instead: the sampled
            path's variable-size candidate scan would read the device (a sync) per tensor.
        sample: fraction of elements sampled to estimate the threshold (at least 4096;
            0.1% as in DGC). More => a tighter threshold and a rarer fallback, slower
            sampling.
    """

    approximate: bool = False
    sample: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float(self, "sample", low=0.0, high=1.0, low_open=True)


class TopKCompressor(SeededCompressor):
    """Keeps the k entries of largest magnitude (see the module docstring)."""

    name = "topk"
    aggregation = Aggregation.GATHER
    unbiased = False

    memory_passes = 5.0  # select, gather the pairs; decode zeroes and scatters

    def __init__(self, config: TopKConfig | None = None) -> None:
        self.config = config or TopKConfig()
        super().__init__(self.config.seed)

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        """(k,) values in the input's dtype; (k,) indices (int32 below 2**31 elements)."""
        return pairs_layout(self.config.count(math.prod(shape)), math.prod(shape), dtype)

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        check_compressible(tensor, self.name)
        flat = tensor.detach().reshape(-1)
        k = self.config.count(flat.numel())
        idx = None
        # the sampled threshold saves CPU time; on a GPU torch.topk's radix select is the
        # fast path, and the sample's count of candidates would be a host read (a sync)
        if self.config.approximate and flat.numel() > BLOCK and cpu_fast(flat):
            idx = self._approximate(flat, k, self.generator_for(tensor, generator))
        if idx is None:
            idx = torch.topk(flat.abs(), k, sorted=False).indices
        idx = ascending(idx)  # the wire's order (receivers check it in one pass)
        values = flat[idx]
        if self.checks_finite:  # topk ranks NaN and Inf first: the values carry them
            ensure_finite(flat, values, self.name)
        return Payload(tensors=(values, idx.to(index_dtype(flat.numel()))),
                       shape=tensor.shape, dtype=tensor.dtype)

    def _approximate(self, flat: Tensor, k: int, gen: torch.Generator) -> Tensor | None:
        """Indices of the top-k among the entries above a sampled threshold (in no
        particular order); None if fewer than k pass."""
        n = flat.numel()
        m = min(n, max(4096, math.ceil(self.config.sample * n)))
        sample = flat[torch.randint(n, (m,), generator=gen, device=flat.device)].abs()
        # aim a little below the k-th largest: keep ~1.2x the expected sample count + 4 sigma
        expected = m * k / n
        rank = min(m, math.ceil(1.2 * expected + 4 * math.sqrt(expected) + 1))
        threshold = float(torch.topk(sample, rank, sorted=False).values.min())
        candidates, values = above(flat, threshold)
        if candidates.numel() < k:
            return None
        return largest(candidates, values, k)

    def decompress(self, payload: Payload) -> Tensor:
        values, indices = payload.tensors
        return scatter(payload, values, indices)

    def payload_fault(self, payload: Payload) -> Tensor:
        """Values NaN/Inf, indices (bucket positions) out of range or repeated."""
        if "parts" in payload.meta:
            return super().payload_fault(payload)
        values, indices = payload.tensors
        return pairs_fault(values, indices, payload.shape.numel(), payload.dtype)

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor:
        values, indices = payload.tensors
        return scatter(payload, values, indices, out, add)

    def compress_segments(self, flat: Tensor, segments: Segments,
                          generator: torch.Generator | None = None) -> Payload:
        """Each segment's top-k, one ``topk`` per distinct segment length
        (:mod:`hexagram.compress.sparse_segments`); a large segment on the CPU takes the
        sampled threshold, as :meth:`compress` does."""
        if not seg_ops.fits(segments):
            return super().compress_segments(flat, segments, generator)
        check_compressible(flat, self.name)
        flat = flat.detach()

        def sampled(rows: Tensor, k: int, members: tuple[int, ...]) -> Tensor | None:
            start = segments.offsets[members[0]]
            view = flat[start:start + rows.shape[1]]
            if len(members) > 1 or not (self.config.approximate and view.numel() > BLOCK
                                        and cpu_fast(view)):
                return None
            chosen = self._approximate(view, k, self.generator_for(flat, generator))
            return None if chosen is None else chosen.view(1, -1)

        positions = seg_ops.top_positions(flat.abs(), segments, self.config.count, sampled)
        payload = seg_ops.pairs_payload(flat, positions, segments)
        if self.checks_finite:  # topk ranks NaN and Inf first: the values carry them
            ensure_finite(flat, payload.tensors[0], self.name)
        return payload

    def decompress_segments_into(self, payload: Payload, out: Tensor,
                                 add: bool = False) -> Tensor:
        if "parts" in payload.meta:  # the per-segment payload of a huge bucket
            return super().decompress_segments_into(payload, out, add)
        values, positions = payload.tensors
        return seg_ops.scatter_pairs(values, positions, out, add)

    def __repr__(self) -> str:
        return f"TopKCompressor({self.config})"


class RandomKCompressor(SeededCompressor):
    """Keeps k entries drawn by stratified sampling (see the module docstring)."""

    name = "randomk"
    aggregation = Aggregation.GATHER
    #: a sum over the input (the finiteness check) and the decode's zero fill; the draws,
    #: gathers and scatters touch only the kept entries
    memory_passes = 2.0

    def __init__(self, config: RandomKConfig | None = None) -> None:
        self.config = config or RandomKConfig()
        super().__init__(self.config.seed)
        self.unbiased = self.config.rescale

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        """(k,) values in the input's dtype; (k,) indices (int32 below 2**31 elements)."""
        return pairs_layout(self.config.count(math.prod(shape)), math.prod(shape), dtype)

    @staticmethod
    def _strata(n: int, k: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Start (k,) and size (k,) of the k strata ``[floor(j n / k), floor((j+1) n / k))``."""
        bounds = torch.arange(k + 1, dtype=torch.int64, device=device) * n // k
        return bounds[:-1], bounds[1:] - bounds[:-1]

    @staticmethod
    def _positions(u: Tensor, n: int) -> Tensor:
        """int64 ``start[j] + min(floor(u[j] size[j]), size[j] - 1)`` over the strata of
        :meth:`_strata` (k = ``u.numel()``), computed in float64: every value is an integer
        below 2**53, ``floor(float(j n) / k)`` equals ``j n // k`` (a non-integer quotient
        lies at least 1/k below the next integer, far above float64's rounding), so the
        positions are those of the int64 formula, bit for bit, without its int64 division
        (8.5 -> 4.6 ms of CPU for k = 629K, one thread)."""
        k = u.numel()
        if (k + 1) * n >= 2**53:  # beyond float64's exact integers: the int64 formula
            start, size = RandomKCompressor._strata(n, k, u.device)
            return start + (u * size).long().clamp_(max=size - 1)
        bounds = torch.arange(k + 1, dtype=torch.float64, device=u.device).mul_(n).div_(k)
        bounds.floor_()
        size = bounds[1:] - bounds[:-1]
        offset = torch.mul(u, size).floor_()
        torch.minimum(offset, size.sub_(1.0), out=offset)
        return offset.add_(bounds[:-1]).long()

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        check_compressible(tensor, self.name)
        flat = tensor.detach().reshape(-1)
        if self.checks_finite:  # NaN/Inf: whole input (exact if the sum overflows)
            ensure_finite(flat, flat.sum(), self.name)
        n = flat.numel()
        u = torch.rand(self.config.count(n), dtype=torch.float64, generator=self.generator_for(
            tensor, generator), device=flat.device)
        idx = self._positions(u, n)  # uniform within each stratum
        return Payload(tensors=(flat[idx], idx.to(index_dtype(n))), shape=tensor.shape,
                       dtype=tensor.dtype)

    def decompress(self, payload: Payload) -> Tensor:
        return decompress_via_into(self, payload)

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor:
        values, indices = payload.tensors
        if self.config.rescale:  # x_i / P(i kept): the stratum size, recomputed from k and n
            _, size = self._strata(payload.shape.numel(), values.numel(), values.device)
            # an overflow decodes to Inf, which payload_fault flags (read once per step)
            values = values.to(work_dtype(payload.dtype)) * size
        return scatter(payload, values, indices, out, add)

    def payload_fault(self, payload: Payload) -> Tensor:
        """Values NaN/Inf or past the range once rescaled; an index outside its stratum
        (each slot's stratum is known to both sides: out of range or repeated both show)."""
        if "parts" in payload.meta:
            return super().payload_fault(payload)
        values, indices = payload.tensors
        if "segments" in payload.meta:
            segments: Segments = payload.meta["segments"]
            start, size = seg_ops.strata(segments, self.config.count, values.device)
            widest = max(-(-n // self.config.count(n)) for n in segments.lengths)
        else:
            n = payload.shape.numel()
            start, size = self._strata(n, values.numel(), values.device)
            widest = -(-n // values.numel())
        outside = ((indices < start) | (indices >= start + size)).any()
        factor = float(widest) if self.config.rescale else 1.0
        return any_of([beyond(values, payload.dtype, factor), outside])

    def _segmented(self, segments: Segments) -> bool:
        return seg_ops.fits(segments) and all(  # strata in exact float64 integers
            (self.config.count(n) + 1) * n < 2**53 for n, _ in segments.by_length)

    def compress_segments(self, flat: Tensor, segments: Segments,
                          generator: torch.Generator | None = None) -> Payload:
        """One draw for the bucket, every tensor's strata at once (positions per tensor
        as :meth:`compress` draws them from the same uniforms)."""
        if not self._segmented(segments):
            return super().compress_segments(flat, segments, generator)
        check_compressible(flat, self.name)
        flat = flat.detach()
        if self.checks_finite:
            ensure_finite(flat, flat.sum(), self.name)
        start, size = seg_ops.strata(segments, self.config.count, flat.device)
        u = torch.rand(start.numel(), dtype=torch.float64, device=flat.device,
                       generator=self.generator_for(flat, generator))
        return seg_ops.pairs_payload(flat, seg_ops.random_positions(u, start, size), segments)

    def decompress_segments_into(self, payload: Payload, out: Tensor,
                                 add: bool = False) -> Tensor:
        if "parts" in payload.meta:
            return super().decompress_segments_into(payload, out, add)
        values, positions = payload.tensors
        if self.config.rescale:  # x_i / P(i kept): the stratum sizes, recomputed
            _, size = seg_ops.strata(payload.meta["segments"], self.config.count, out.device)
            values = values.to(work_dtype(payload.dtype)) * size
        return seg_ops.scatter_pairs(values, positions, out, add)

    def __repr__(self) -> str:
        return f"RandomKCompressor({self.config})"
