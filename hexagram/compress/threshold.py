"""The ``threshold`` sparsifier: every entry with ``|x| >= threshold``, in a payload of fixed
capacity (see :mod:`hexagram.compress.sparsify` for the wire format).

Example:
    >>> import torch
    >>> c = ThresholdCompressor(ThresholdConfig(threshold=1.0, max_density=0.5))
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
    Compressor,
    Layout,
    Payload,
    check_compressible,
    decompress_via_into,
    ensure_finite,
)
from hexagram.compress.faults import any_of, beyond, out_of_range, unordered
from hexagram.compress.segments import Segments
from hexagram.compress.sparse_select import (
    above,
    ascending,
    index_dtype,
    largest,
    pairs_fault,
    scatter,
)
from hexagram.config import check_float

__all__ = ["ThresholdCompressor", "ThresholdConfig"]


@dataclass(frozen=True, kw_only=True)
class ThresholdConfig:
    """Settings of ``threshold``.

    Attributes:
        threshold: entries with ``|x| >= threshold`` are sent. Higher => fewer entries.
        max_density: capacity of the payload as a fraction of the elements (the wire size
            is fixed by it). Higher => more bytes, fewer entries dropped when many pass.
    """

    threshold: float = 1e-3
    max_density: float = 0.01

    def __post_init__(self) -> None:
        check_float(self, "threshold", low=0.0, low_open=True)
        check_float(self, "max_density", low=0.0, high=1.0, low_open=True)


class ThresholdCompressor(Compressor):
    """Sends entries with ``|x| >= threshold`` in a fixed-capacity payload."""

    name = "threshold"
    aggregation = Aggregation.GATHER
    unbiased = False
    #: the comparison (a read, a byte mask written and read back) and the decode's zero fill
    memory_passes = 2.5

    def __init__(self, config: ThresholdConfig | None = None) -> None:
        self.config = config or ThresholdConfig()

    def capacity(self, n: int) -> int:
        """Slots in the payload of an ``n``-element tensor."""
        return min(n, max(1, math.ceil(self.config.max_density * n)))

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        """(1,) int32 count; (c,) values; (c,) indices, c = :meth:`capacity`."""
        n = math.prod(shape)
        cap = self.capacity(n)
        return (((1,), torch.int32), ((cap,), dtype), ((cap,), index_dtype(n)))

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        check_compressible(tensor, self.name)
        flat = tensor.detach().reshape(-1)
        n, cap = flat.numel(), self.capacity(flat.numel())
        chosen, kept = above(flat, self.config.threshold)
        if chosen.numel() > cap:  # topk ranks NaN first: checked below
            chosen = ascending(largest(chosen, kept, cap))  # the wire's order
            kept = flat[chosen]
        ensure_finite(flat, kept, self.name)
        values = flat.new_zeros(cap)
        indices = torch.zeros(cap, dtype=index_dtype(n), device=flat.device)
        values[: chosen.numel()] = kept
        indices[: chosen.numel()] = chosen.to(indices.dtype)
        count = torch.tensor([chosen.numel()], dtype=torch.int32, device=flat.device)
        return Payload(tensors=(count, values, indices), shape=tensor.shape, dtype=tensor.dtype)

    def decompress(self, payload: Payload) -> Tensor:
        return decompress_via_into(self, payload)

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor:
        count, values, indices = payload.tensors
        # reads the count (a sync); a received count outside [0, capacity] is clamped
        used = min(max(int(count[0]), 0), values.numel())
        return scatter(payload, values[:used], indices[:used], out, add)

    def payload_fault(self, payload: Payload) -> Tensor:
        """Per tensor: the count outside ``[0, capacity]``, or a used slot's value NaN/Inf
        or index out of range, or the used indices not strictly increasing (slots past the
        count are not decoded). Per bucket: as top-k's pairs (every slot a distinct
        position, ascending)."""
        if "parts" in payload.meta:
            return super().payload_fault(payload)
        if "segments" in payload.meta:
            values, positions = payload.tensors
            return pairs_fault(values, positions, payload.shape.numel(), payload.dtype)
        count, values, indices = payload.tensors
        slot = torch.arange(values.numel(), device=values.device)
        used = slot < count
        n = payload.shape.numel()
        # unused slots become keys past every index, increasing: only used ones can be out
        # of order
        keys = torch.where(used, indices.long(), n + slot)
        return any_of([(count < 0) | (count > values.numel()),
                       beyond(torch.where(used, values, 0), payload.dtype),
                       out_of_range(torch.where(used, keys, 0), n), unordered(keys)])

    def compress_segments(self, flat: Tensor, segments: Segments,
                          generator: torch.Generator | None = None) -> Payload:
        """Each segment's entries with ``|x| >= threshold``, up to its capacity (the
        largest), as the capacity largest of ``|x|`` with the rest set to -1; slots that
        did not pass send value 0. No count is sent (the slots say it): 4 bytes a tensor
        fewer than per tensor."""
        if not seg_ops.fits(segments):
            return super().compress_segments(flat, segments, generator)
        check_compressible(flat, self.name)
        flat = flat.detach()
        score = flat.abs()
        score.masked_fill_(score < self.config.threshold, -1.0)  # NaN passes, as alone
        positions = seg_ops.top_positions(score, segments, self.capacity)
        values = flat.index_select(0, positions)
        if self.checks_finite:
            ensure_finite(flat, values, self.name)
        values.masked_fill_(score.index_select(0, positions) < 0, 0.0)
        return seg_ops.pairs_payload(flat, positions, segments, values)

    def decompress_segments_into(self, payload: Payload, out: Tensor,
                                 add: bool = False) -> Tensor:
        if "parts" in payload.meta:
            return super().decompress_segments_into(payload, out, add)
        values, positions = payload.tensors
        return seg_ops.scatter_pairs(values, positions, out, add)

    def __repr__(self) -> str:
        return f"ThresholdCompressor({self.config})"
