"""A bucket's layout, built once per set of tensors: the one cache of the algorithms that
work a bucket at a time.

An algorithm that compresses a whole bucket in one call keeps host facts per bucket
(names, sizes, :class:`~hexagram.compress.segments.Segments`, its own plans) so that no
step builds anything per tensor. :class:`LayoutCache` keeps one layout per bucket index,
rebuilt only when the engine re-forms its buckets, and shared by a wrapper's
double-buffered copies of one bucket (``delay=1``'s stashes: the same tensors, another
entry list), so they never rebuild it in turn.

Example:
    >>> from hexagram.buckets import Bucket
    >>> import torch
    >>> bucket = Bucket(0, [("w", torch.nn.Parameter(torch.zeros(3)))])
    >>> cache = LayoutCache()
    >>> build = lambda b, names, lengths: BucketLayout(b.entries, names, lengths, None)
    >>> cache.of(bucket, build) is cache.of(bucket, build), cache.of(bucket, build).names
    (True, ('w',))
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from hexagram.buckets import Bucket, BucketEntry
from hexagram.compress.segments import Segments

__all__ = ["BucketLayout", "LayoutCache"]


@dataclass(frozen=True, eq=False)  # one per bucket layout, compared by identity
class BucketLayout:
    """What an algorithm keeps per bucket layout, built once (first step, and again when
    the engine re-forms its buckets) and reused every step.

    Attributes:
        entries: the bucket's entries (the list object itself: its identity is the layout).
        names: their parameter names, in buffer order (the error-feedback keys).
        lengths: their sizes.
        segments: ``granularity="layer"``: each tensor a segment of one
            :meth:`~hexagram.compress.base.Compressor.compress_segments` call; ``None``:
            the bucket compressed as one tensor.
        aliases: other entry lists of the same names and sizes (a wrapper's copies of the
            bucket): the same layout, so the error-feedback buffer stays bound.
    """

    entries: list[BucketEntry]
    names: tuple[str, ...]
    lengths: tuple[int, ...]
    segments: Segments | None
    aliases: list[list[BucketEntry]] = dataclasses.field(default_factory=list)

    def describes(self, entries: list[BucketEntry]) -> bool:
        """True if ``entries`` is this layout's list or an alias of it (identity: one
        comparison per known list, nothing per tensor)."""
        return entries is self.entries or any(entries is a for a in self.aliases)

    @functools.cached_property
    def described(self) -> str:
        """The parameter names, for messages (built once)."""
        return ", ".join(self.names)


LayoutT = TypeVar("LayoutT", bound=BucketLayout)


class LayoutCache(Generic[LayoutT]):
    """One layout per bucket index, built by ``build(bucket, names, lengths)`` (given at
    each call, so the cache holds no reference back to its algorithm: no cycle) when the
    bucket's tensors change; ``build`` may return None where the algorithm takes that
    bucket another way (it is then asked again at the next step)."""

    def __init__(self) -> None:
        self._known: dict[int, LayoutT] = {}

    def of(self, bucket: Bucket, build: Callable[[Bucket, tuple[str, ...], tuple[int, ...]],
                                                LayoutT | None]) -> LayoutT | None:
        """``bucket``'s layout: the known one if it describes the bucket's entries (or the
        same names and sizes: it becomes an alias), else a new one from ``build``."""
        known = self._known.get(bucket.index)
        if known is not None and known.describes(bucket.entries):
            return known
        names = tuple(e.name for e in bucket.entries)
        lengths = tuple(e.numel for e in bucket.entries)
        if known is not None and (known.names, known.lengths) == (names, lengths):
            known.aliases.append(bucket.entries)  # another buffer of the same tensors
            return known
        layout = build(bucket, names, lengths)
        if layout is None:
            self._known.pop(bucket.index, None)
        else:
            self._known[bucket.index] = layout
        return layout
