"""Several tensors laid end to end in one flat buffer, compressed in one call.

A bucket holds many parameter tensors in one 1-D buffer. Compressing it tensor by tensor
(``granularity="layer"``: a scale, a norm or a top-k per tensor) costs dozens of small
kernels per tensor, so a model of 150 tensors makes thousands of launches a step. A
:class:`Segments` describes where each tensor lies in the buffer;
:meth:`hexagram.compress.base.Compressor.compress_segments` compresses the whole buffer at
once while keeping the per-tensor statistics (per-tensor scales from ``_foreach_*``
reductions, element-wise work over the whole buffer), and the matching
:meth:`~hexagram.compress.base.Compressor.decompress_segments_into` decodes it in one call.

Example:
    >>> import torch
    >>> seg = Segments.of([3, 2])
    >>> seg.offsets, seg.numel
    ((0, 3), 5)
    >>> [v.tolist() for v in seg.views(torch.arange(5.0))]
    [[0.0, 1.0, 2.0], [3.0, 4.0]]
    >>> seg.expand(torch.tensor([1.0, 2.0]), torch.device("cpu")).tolist()
    [1.0, 1.0, 1.0, 2.0, 2.0]
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["Segments"]


@dataclass(frozen=True, eq=False)
class Segments:
    """Where each tensor of a flat buffer lies: segment ``i`` is
    ``flat[offsets[i] : offsets[i] + lengths[i]]``; segments tile ``flat[:numel]`` in order.

    Host-side facts only (shapes are known to every rank, never data): a ``Segments`` is
    built once per bucket layout and reused every step, and the device tensors derived from
    it (lengths, offsets, the per-element segment index) are cached per device, so no step
    copies host data to the device. Compared (and hashed) by identity.

    Attributes:
        lengths: the number of elements of each segment (each at least 1).
        offsets: where each segment starts (prefix sums of ``lengths``).
        numel: the total, ``sum(lengths)``.
    """

    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    _cache: dict[tuple[Hashable, str], Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, lengths: Sequence[int]) -> Segments:
        """Segments of the given lengths, laid end to end from offset 0.

        Raises ValueError for no segments or an empty one (a compressor cannot encode an
        empty tensor).
        """
        lens = tuple(int(n) for n in lengths)
        if not lens or min(lens) < 1:
            raise ValueError(f"segments need at least one segment and every length >= 1, "
                             f"got lengths {list(lens)[:8]}")
        offsets = tuple(itertools.accumulate((0, *lens[:-1])))
        return cls(lens, offsets, sum(lens))

    def __len__(self) -> int:
        return len(self.lengths)

    def views(self, flat: Tensor) -> list[Tensor]:
        """One 1-D view of ``flat`` per segment (no copy)."""
        return [flat[o:o + n] for o, n in zip(self.offsets, self.lengths)]

    def cached(self, what: Hashable, device: torch.device, make: Callable[[], Tensor]) -> Tensor:
        """``make()``, built once per ``what`` and device and kept with this layout: the
        place for a compressor's per-layout tables (strata, gather indices), so that no
        step copies host data to the device."""
        key = (what, str(device))
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def device_lengths(self, device: torch.device) -> Tensor:
        """``lengths`` as an int64 tensor on ``device`` (cached)."""
        return self.cached("lengths", device,
                            lambda: torch.tensor(self.lengths, dtype=torch.int64, device=device))

    def device_offsets(self, device: torch.device) -> Tensor:
        """``offsets`` as an int64 tensor on ``device`` (cached)."""
        return self.cached("offsets", device,
                            lambda: torch.tensor(self.offsets, dtype=torch.int64, device=device))

    def index(self, device: torch.device) -> Tensor:
        """(numel,) int32: the segment of each element, on ``device`` (cached: built once
        per layout; 4 bytes an element, so prefer :meth:`expand` of per-segment values
        where a kernel can take them)."""
        return self.cached("index", device, lambda: torch.repeat_interleave(
            torch.arange(len(self), dtype=torch.int32, device=device),
            self.device_lengths(device), output_size=self.numel))

    def expand(self, values: Tensor, device: torch.device) -> Tensor:
        """(numel, ...) ``values[i]`` repeated over segment ``i`` (``values``: (len, ...)).

        One kernel and no host read (the output size is known on the host).
        """
        return torch.repeat_interleave(values, self.device_lengths(device), dim=0,
                                       output_size=self.numel)

    @functools.cached_property
    def by_length(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """``(length, indices of the segments of that length)`` per distinct length, in
        order of first appearance: a transformer's dozens of tensors have a handful of
        sizes, and segments of one size are compressed as the rows of one matrix.

        >>> Segments.of([3, 2, 3]).by_length
        ((3, (0, 2)), (2, (1,)))
        """
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(self.lengths):
            groups.setdefault(n, []).append(i)
        return tuple((n, tuple(members)) for n, members in groups.items())

    def rows(self, flat: Tensor, members: tuple[int, ...]) -> Tensor:
        """(len(members), n): the segments ``members`` of ``flat`` (all of length n) as
        rows. A view (no copy) where they lie at equal distances (one tensor, or the same
        tensor of repeated blocks), else one gather through an index cached per device.

        >>> Segments.of([2, 1, 2]).rows(torch.arange(5.0), (0, 2)).tolist()
        [[0.0, 1.0], [3.0, 4.0]]
        """
        n, starts = self.lengths[members[0]], [self.offsets[i] for i in members]
        steps = {b - a for a, b in itertools.pairwise(starts)}
        if len(steps) <= 1 and flat.stride(0) == 1:
            step = steps.pop() if steps else n
            return flat.as_strided((len(members), n), (step, 1),
                                   flat.storage_offset() + starts[0])
        index = self.cached(("rows", members), flat.device, lambda: (
            torch.tensor(starts, dtype=torch.int64, device=flat.device)[:, None]
            + torch.arange(n, device=flat.device)).reshape(-1))
        return flat.index_select(0, index).view(len(members), n)

    def starts(self, members: tuple[int, ...], device: torch.device) -> Tensor:
        """(len(members), 1) int64: where each of the segments ``members`` starts (cached)."""
        return self.cached(("starts", members), device, lambda: torch.tensor(
            [self.offsets[i] for i in members], dtype=torch.int64, device=device)[:, None])
