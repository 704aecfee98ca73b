"""Per-tensor statistics of the sign compressors, for one tensor or a whole bucket.

``sign`` (scaled), ``efsign`` and ``onebit`` scale their sign bits by a statistic of each
tensor: rms(x), mean |x|, the means of the negative and non-negative halves. One function
computes them for every segment of a bucket (:class:`~hexagram.compress.segments.Segments`)
with ``torch._foreach_norm`` reductions over the segments' views, whatever the number of
segments; ``compress`` of a single tensor calls it with one view, so a tensor compressed
alone and inside a bucket gets the same header bits.

Sums of magnitudes are float64 (no overflow to detect, nothing read back); the CPU's L2
norm is taken in float32 as before (float64 where it overflowed), the device's in float64.
Counts are exact integers: ``x < 0`` counted by a float64 ``ord=0`` norm on the CPU and by
a prefix sum on the device (whose ``_foreach_norm`` has no fast ``ord=0``).

Example:
    >>> import torch
    >>> x = torch.tensor([1.0, -3.0, 0.0, 2.0, -1.0])
    >>> onebit_means(x, Segments.of([3, 2])).tolist()
    [[-3.0, 0.5], [-1.0, 2.0]]
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hexagram.compress.chunks import work_dtype
from hexagram.compress.packing import cpu_fast
from hexagram.compress.segments import Segments

__all__ = ["abs_means", "header_of", "norms", "onebit_means", "rms", "segment_counts"]


def norms(views: tuple[Tensor, ...] | list[Tensor], order: float, device: torch.device
          ) -> Tensor:
    """(S,) float64: the ``order``-norm of each view, with float64 sums (float32 ones
    drift: 7e-5 relative on 2M float32 values with ``ord=1`` on the CPU); the CPU takes
    the L2 norm in the work dtype (its float32 norm is accurate) and recomputes in float64
    the segments where it overflowed."""
    if order != 2 or not cpu_fast(device):
        return torch.stack(torch._foreach_norm(views, order, dtype=torch.float64))
    wd = work_dtype(views[0].dtype)
    got = torch.stack(torch._foreach_norm(views, order, dtype=wd)).double()
    bad = (~torch.isfinite(got)).nonzero().flatten().tolist()  # the CPU reads for free
    if bad:  # huge finite values overflowed float32 (NaN/Inf stay non-finite)
        again = torch._foreach_norm([views[i] for i in bad], order, dtype=torch.float64)
        got[bad] = torch.stack(again)
    return got


def abs_means(flat: Tensor, segments: Segments) -> Tensor:
    """(S,) float64 ``sum |x| / n`` of each segment of ``flat``: ``efsign``'s scale."""
    return norms(flat.split(segments.lengths), 1, flat.device) / _lengths(segments,
                                                                          flat.device)


def rms(flat: Tensor, segments: Segments) -> Tensor:
    """(S,) float64 ``||x||_2 / sqrt(n)`` of each segment of ``flat``: scaled ``sign``'s
    header."""
    n = _lengths(segments, flat.device)
    return norms(flat.split(segments.lengths), 2, flat.device) / (
        math.sqrt(n) if isinstance(n, float) else n.sqrt())


def onebit_means(flat: Tensor, segments: Segments) -> Tensor:
    """(S, 2) float64 ``[mean of x < 0, mean of x >= 0]`` of each segment of ``flat``,
    0 for an empty half: ``onebit``'s reconstruction values.

    The halves' sums are norms of ``max(x, 0)`` and ``min(x, 0)`` (no cancellation, unlike
    ``(sum x +- sum |x|) / 2``), through one temporary as large as ``flat``.
    """
    device = flat.device
    part = torch.clamp(flat, min=0)
    pos = norms(part.split(segments.lengths), 1, device)
    neg_views = torch.clamp(flat, max=0, out=part).split(segments.lengths)
    neg = norms(neg_views, 1, device)
    if cpu_fast(device):  # x < 0 exactly where min(x, 0) != 0 (-0.0 counts as >= 0)
        n_neg = torch.stack(torch._foreach_norm(neg_views, 0, dtype=torch.float64))
    else:
        n_neg = segment_counts(torch.lt(flat, 0), segments).double()
    n_pos = _lengths(segments, device) - n_neg
    return torch.stack([torch.where(n_neg > 0, -neg / n_neg.clamp(min=1), 0.0),
                        torch.where(n_pos > 0, pos / n_pos.clamp(min=1), 0.0)], 1)


def segment_counts(mask: Tensor, segments: Segments) -> Tensor:
    """(S,) int64: the true entries of each segment of the 1-D bool ``mask``: a prefix sum
    read at the segments' ends, exact and in a fixed number of kernels."""
    wide = torch.int64 if mask.numel() >= 2**31 else torch.int32
    if len(segments) == 1:
        return mask.sum(dtype=torch.int64).reshape(1)
    ends = segments.device_offsets(mask.device) + segments.device_lengths(mask.device) - 1
    at_ends = mask.cumsum(0, dtype=wide).index_select(0, ends).long()
    return torch.diff(at_ends, prepend=at_ends.new_zeros(1))


def _lengths(segments: Segments, device: torch.device) -> Tensor | float:
    """The segments' lengths as float64 on ``device`` (cached there), a Python float for
    one segment (a per-tensor call copies nothing to the device)."""
    if len(segments) == 1:
        return float(segments.numel)
    return segments.device_lengths(device).double()


def header_of(values: Tensor, dtype: torch.dtype, who: str, check: bool) -> Tensor:
    """float64 ``values`` as a header in the work dtype of ``dtype``; ``check``: a
    ValueError when a value overflows it (finite input, too large for the header)."""
    header = values.to(work_dtype(dtype))
    if check and not bool(torch.isfinite(header).all()):
        raise ValueError(f"{who}: a reconstruction value overflows {header.dtype}; scale "
                         "the tensor down first")
    return header
