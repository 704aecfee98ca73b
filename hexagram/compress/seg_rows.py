"""Per-tensor chunks of a segmented buffer as the rows of one padded matrix.

The chunked formats (``minmax8``, ``minmax4``, ``qsgd``, and ``efsign`` / ``onebit`` with
``block``) cut each tensor into chunks of ``c`` elements, the last one shorter. Laid end to
end in a bucket (:class:`~hexagram.compress.segments.Segments`), those chunks do not sit
on one grid of ``c``, so no single view reduces them. A :class:`RowLayout` gathers the
buffer into a ``(rows, c)`` matrix whose row ``r`` holds one chunk of one tensor, the
short last chunk of each tensor padded (with zeros, or with copies of the tensor's last
element where a minimum or maximum must not see a zero): then one row reduction gives
every chunk's statistic, one broadcast op encodes every chunk, one gather compacts the
codes back to the buffer's order, and one gather expands per-row values to elements.

A layout is built once per (segments, chunk, device) from host facts alone and cached;
its index tensors (int32) cost 4 bytes per element each, on the device.

Example:
    >>> import torch
    >>> from hexagram.compress.segments import Segments
    >>> lay = row_layout(Segments.of([3, 2]), 2, torch.device("cpu"))
    >>> lay.rows, lay.seg_rows
    (3, (2, 1))
    >>> padded(torch.arange(1.0, 6.0), lay, zero=True).tolist()
    [[1.0, 2.0], [3.0, 0.0], [4.0, 5.0]]
    >>> padded(torch.arange(1.0, 6.0), lay, zero=False)[1].tolist()
    [3.0, 3.0]
    >>> lay.row_of.tolist()
    [0, 0, 1, 2, 2]
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from hexagram.compress.segments import Segments

__all__ = ["RowLayout", "compact", "expand_rows", "padded", "row_layout"]


@dataclass(frozen=True)
class RowLayout:
    """Where each chunk of each segment lies in a padded ``(rows, chunk)`` matrix.

    Attributes:
        chunk: elements per row.
        rows: chunks of all segments (``sum(ceil(n_i / chunk))``).
        seg_rows: rows of each segment (host).
        identity: True where every segment is a whole number of chunks: the padded matrix
            is the buffer itself (no gather, no compaction).
        gather: (rows * chunk,) int32: the buffer element of each padded position
            (padding: the segment's last element).
        pads: (P,) int64: the padded positions that are padding.
        pos_of: (numel,) int32: the padded position of each buffer element.
        row_of: (numel,) int32: the row of each buffer element.
        sizes: (rows,) int64: the real elements of each row.
    """

    chunk: int
    rows: int
    seg_rows: tuple[int, ...]
    identity: bool
    gather: Tensor
    pads: Tensor
    pos_of: Tensor
    row_of: Tensor
    sizes: Tensor


_CACHE: weakref.WeakKeyDictionary[Segments, dict[tuple[int, str], RowLayout]] = \
    weakref.WeakKeyDictionary()


def row_layout(segments: Segments, chunk: int, device: torch.device) -> RowLayout:
    """The cached :class:`RowLayout` of ``segments`` in chunks of ``chunk`` on ``device``."""
    per = _CACHE.setdefault(segments, {})
    key = (chunk, str(device))
    if key not in per:
        per[key] = _build(segments, chunk, device)
    return per[key]


def _build(segments: Segments, chunk: int, device: torch.device) -> RowLayout:
    """Index tensors computed on the host (int64), then copied to ``device`` once."""
    lens = torch.tensor(segments.lengths, dtype=torch.int64)
    offs = torch.tensor(segments.offsets, dtype=torch.int64)
    seg_rows = -(-lens // chunk)
    rows = int(seg_rows.sum())
    pstart = chunk * (torch.cumsum(seg_rows, 0) - seg_rows)  # padded start of each segment
    seg_of_elem = torch.repeat_interleave(torch.arange(len(segments)), lens)
    pos_of = torch.arange(segments.numel) + (pstart - offs)[seg_of_elem]
    seg_of_pos = torch.repeat_interleave(torch.arange(len(segments)), seg_rows * chunk)
    local = torch.arange(rows * chunk) - pstart[seg_of_pos]
    gather = offs[seg_of_pos] + torch.minimum(local, lens[seg_of_pos] - 1)
    pads = (local >= lens[seg_of_pos]).nonzero().flatten()
    sizes = torch.full((rows,), chunk, dtype=torch.int64)
    last = torch.cumsum(seg_rows, 0) - 1
    sizes[last] = lens - (seg_rows - 1) * chunk
    index = torch.int32 if rows * chunk < 2**31 else torch.int64
    return RowLayout(chunk, rows, tuple(int(r) for r in seg_rows), pads.numel() == 0,
                     gather.to(device, index), pads.to(device), pos_of.to(device, index),
                     (pos_of // chunk).to(device, index), sizes.to(device))


def padded(flat: Tensor, layout: RowLayout, zero: bool) -> Tensor:
    """``(rows, chunk)``: the chunks of ``flat`` padded with zeros (``zero``) or with the
    segment's last element (a row's min and max stay its chunk's). No copy when
    ``layout.identity``."""
    if layout.identity:
        return flat.view(layout.rows, layout.chunk)
    out = flat.index_select(0, layout.gather)
    if zero:
        out.index_fill_(0, layout.pads, 0)
    return out.view(layout.rows, layout.chunk)


def compact(values: Tensor, layout: RowLayout) -> Tensor:
    """``(numel,)``: the elements of a padded ``(rows * chunk,)`` tensor in buffer order."""
    values = values.reshape(-1)
    return values if layout.identity else values.index_select(0, layout.pos_of)


def expand_rows(values: Tensor, layout: RowLayout) -> Tensor:
    """``(numel, ...)``: ``values[row]`` (``values``: (rows, ...)) for every element."""
    if layout.identity and layout.chunk == 1:
        return values
    return values.index_select(0, layout.row_of)
