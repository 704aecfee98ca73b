"""Sparsifiers over a whole bucket: top-k, random-k and threshold per tensor in one call.

The segmented payloads of :mod:`hexagram.compress.sparsify` keep each tensor's own ``k``
(or capacity) and carry every pair of the bucket in two tensors: values ``(K,)`` and *bucket*
positions ``(K,)``, ascending (int32: a bucket of 2**31 elements or more goes segment by
segment, where each tensor's own indices still fit), ``K`` the sum of the per-tensor counts, so the
wire size is the per-tensor one. Decoding is one zero fill and one ``index_add_`` for the
bucket; error feedback subtracts the pairs from the corrected bucket in the same two passes.

- top-k: segments of one length are the rows of one matrix (a view where they lie at equal
  distances, else one gather): one ``torch.topk(dim=1)`` per distinct length, the exact
  per-tensor selection (the same values as ``compress`` per tensor, up to ties).
- random-k: one draw of ``K`` uniforms for the bucket; each tensor's strata are computed for
  all slots at once (float64, exact integers), giving per tensor the positions ``compress``
  gives for the same uniforms.
- threshold: magnitudes below the threshold become -1 and each tensor keeps the
  ``capacity`` largest (the top-k above); slots that did not pass send value 0.

Example:
    >>> import torch, hexagram.compress as hc
    >>> from hexagram.compress.segments import Segments
    >>> c, seg = hc.get("topk", k=1), Segments.of([3, 2])
    >>> p = c.compress_segments(torch.tensor([1.0, -4.0, 2.0, 0.5, -1.0]), seg)
    >>> p.tensors[1].tolist(), c.decompress_segments_into(p, torch.empty(5)).tolist()
    ([1, 4], [0.0, -4.0, 0.0, 0.0, -1.0])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from hexagram.compress.base import Payload
from hexagram.compress.faults import clamp_index
from hexagram.compress.segments import Segments
from hexagram.compress.sparse_select import ascending

__all__ = ["fits", "pairs_payload", "scatter_pairs", "strata", "top_positions"]

#: bucket positions are int32 below this many elements
_INT32 = 2**31


def fits(segments: Segments) -> bool:
    """True where bucket positions fit the per-tensor int32 indices (else the caller goes
    segment by segment, the payload then the per-tensor ones)."""
    return segments.numel < _INT32


def top_positions(score: Tensor, segments: Segments, count: Callable[[int], int],
                  largest: Callable[[Tensor, int, tuple[int, ...]], Tensor | None]
                  | None = None) -> Tensor:
    """(K,) int64 bucket positions of the ``count(n)`` largest ``score`` of each segment
    of length ``n`` (one ``topk`` per distinct length), ascending: the wire's order.

    ``largest(rows, k, members)`` may give a group's (g, k) local positions itself (the
    sampled threshold of a large tensor on the CPU); ``None`` falls back to ``topk``.
    """
    parts = []
    for n, members in segments.by_length:
        rows, k = segments.rows(score, members), count(n)
        local = largest(rows, k, members) if largest is not None else None
        if local is None:
            local = torch.topk(rows, k, dim=1, sorted=False).indices
        parts.append((local + segments.starts(members, score.device)).reshape(-1))
    return ascending(parts[0] if len(parts) == 1 else torch.cat(parts))


def pairs_payload(flat: Tensor, positions: Tensor, segments: Segments,
                  values: Tensor | None = None) -> Payload:
    """The segmented (values, int32 positions) payload of ``flat`` at ``positions``."""
    if values is None:
        values = flat.index_select(0, positions)
    return Payload(tensors=(values, positions.to(torch.int32)),
                   shape=torch.Size([segments.numel]), dtype=flat.dtype,
                   meta={"segments": segments})


def scatter_pairs(values: Tensor, positions: Tensor, out: Tensor, add: bool) -> Tensor:
    """``out`` (1-D) := (``add``: ``+=``) the dense tensor of the pairs; returns ``out``.
    Positions are clamped into the bucket (received ones may be anything; the
    compressor's ``payload_fault`` flags those)."""
    if not add:
        out.zero_()
    return out.index_add_(0, clamp_index(positions, out.numel()), values.to(out.dtype))


def strata(segments: Segments, count: Callable[[int], int], device: torch.device
           ) -> tuple[Tensor, Tensor]:
    """(K,) float64 bucket start and (K,) float64 size of every stratum of every segment:
    segment i of ``n`` elements in ``k = count(n)`` strata ``[floor(j n / k), floor((j+1)
    n / k))``, in segment order. float64 holds the integers exactly below 2**53 (the
    caller checks ``(k + 1) n``), and ``floor(j n / k)`` equals ``j n // k`` (see
    :meth:`hexagram.compress.sparsify.RandomKCompressor._positions`), so the strata are
    those of each tensor alone, bit for bit.
    """
    ks = [count(n) for n in segments.lengths]
    total = sum(ks)

    def table() -> Tensor:  # (S, 4): n, k, first slot, offset of each segment
        first = [0]
        for k in ks[:-1]:
            first.append(first[-1] + k)
        return torch.tensor(list(zip(segments.lengths, ks, first, segments.offsets)),
                            dtype=torch.float64, device=device)

    per = segments.cached(("strata", count), device, table)
    counts = segments.cached(("strata_counts", count), device, lambda: torch.tensor(
        ks, dtype=torch.int64, device=device))
    n, k, first, offset = torch.repeat_interleave(per, counts, dim=0,
                                                  output_size=total).unbind(1)
    j = torch.arange(total, dtype=torch.float64, device=device).sub_(first)
    lo = torch.mul(j, n).div_(k).floor_()
    hi = j.add_(1.0).mul_(n).div_(k).floor_()
    return lo.add(offset), hi.sub_(lo)


def random_positions(u: Tensor, start: Tensor, size: Tensor) -> Tensor:
    """int64 ``start + min(floor(u size), size - 1)``: one uniform position per stratum."""
    offset = torch.mul(u, size).floor_()
    torch.minimum(offset, size - 1.0, out=offset)
    return offset.add_(start).long()
