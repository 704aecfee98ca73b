"""Many tensors cut into chunks, laid out as a few (rows, chunk) matrices of one flat buffer.

The per-chunk formats (:mod:`hexagram.compress.chunk_topk`, :mod:`hexagram.compress.dct`)
cut a tensor of ``n`` elements into ``G = ceil(n / c)`` chunks of ``c = min(chunk, n)``
elements, the last one zero-padded. Done tensor by tensor, a model of 150 tensors costs a
few thousand small kernels per exchange. :class:`ChunkRows` lays every tensor out once, in
one flat buffer, so that the chunks of all tensors that share a row format (same ``c``,
same ``k``) form one contiguous (rows, c) matrix: one ``topk`` (or one matrix product) per
*row format*, not per tensor. Tensors of at least ``chunk`` elements all share the first
format (each padded with zeros to whole chunks); a smaller tensor is one row of its own
length, grouped with the tensors of the same length (a model has a few such lengths:
biases and norms).

Padding holds zeros; the per-row ``limits`` (valid columns of each row) let a decoder drop
what a top-k picked there, as the per-tensor decoders drop positions ``>= n``.

:class:`SegmentPacker` packs the codes of several tensors into the bytes their own
``pack_codes`` calls would give, laid end to end: the one payload of a layout has exactly
the wire bytes of the per-tensor payloads.

Example:
    >>> rows = ChunkRows([10, 3, 3], lambda n: (min(4, n), -(-n // min(4, n)), 1, 2))
    >>> rows.numel, [(g.rows, g.width) for g in rows.groups], rows.offsets
    (18, [(3, 4), (2, 3)], (0, 12, 15))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hexagram.compress.packing import pack_codes, packed_nbytes, unpack_codes

__all__ = ["ChunkRows", "RowGroup", "SegmentPacker"]

#: ``n -> (c, G, k, b)``: chunk length, chunks, kept per chunk, position bits of a tensor
RowFormat = Callable[[int], tuple[int, int, int, int]]


@dataclass(frozen=True)
class RowGroup:
    """Rows of one format: ``flat[start : start + rows * width].view(rows, width)``.

    ``counts[j]`` rows belong to the group's ``j``-th tensor, ``tensors[j]`` (its index in
    the layout's input order); ``limits[r]`` is how many columns of row ``r`` hold data
    (``width`` but in a tensor's padded last chunk)."""

    start: int
    rows: int
    width: int
    k: int
    pos_bits: int
    tensors: tuple[int, ...]
    counts: tuple[int, ...]
    limits: tuple[int, ...]
    _cache: dict[str, Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def padded(self) -> bool:
        return min(self.limits) < self.width

    def view(self, flat: Tensor) -> Tensor:
        """The (rows, width) matrix of this group in ``flat``."""
        return flat[self.start : self.start + self.rows * self.width].view(self.rows, self.width)

    def device_limits(self, device: torch.device) -> Tensor:
        """(rows, 1) int64 :attr:`limits` on ``device`` (cached: no host copy per step)."""
        key = f"limits/{device}"
        if key not in self._cache:
            self._cache[key] = torch.tensor(self.limits, device=device).view(-1, 1)
        return self._cache[key]

    def mask_padding(self, pos: Tensor, values: Tensor) -> Tensor:
        """``values`` (rows, k) with zeros where ``pos`` (rows, k) points into padding."""
        if not self.padded:
            return values
        return torch.where(pos < self.device_limits(pos.device), values, 0.0)


class ChunkRows:
    """The chunked layout of tensors of ``numels`` under ``row_format`` (module doc).

    Attributes:
        offsets: where each tensor (input order) starts in the flat buffer.
        numel: elements of the flat buffer (tensors plus padding).
        groups: the row formats, big chunks first.
    """

    def __init__(self, numels: Sequence[int], row_format: RowFormat) -> None:
        if not numels or min(numels) < 1:
            raise ValueError(f"ChunkRows needs tensors of at least one element, got {numels}")
        formats = [row_format(int(n)) for n in numels]
        keys = sorted({(-f[0], f[2], f[3]) for f in formats})  # widest rows first
        offsets, groups, start = [0] * len(numels), [], 0
        for neg_width, k, bits in keys:
            members = [i for i, f in enumerate(formats) if (-f[0], f[2], f[3]) ==
                       (neg_width, k, bits)]
            width, limits = -neg_width, list[int]()
            for i in members:
                offsets[i] = start + len(limits) * width
                rows = formats[i][1]
                limits += [width] * (rows - 1) + [numels[i] - (rows - 1) * width]
            groups.append(RowGroup(start, len(limits), width, k, bits, tuple(members),
                                   tuple(formats[i][1] for i in members), tuple(limits)))
            start += len(limits) * width
        self.numels = tuple(int(n) for n in numels)
        self.offsets = tuple(offsets)
        self.numel = start
        self.groups = tuple(groups)

    def views(self, flat: Tensor, shapes: Sequence[torch.Size] | None = None) -> list[Tensor]:
        """Each tensor's elements in ``flat`` (input order; shaped as ``shapes`` if given)."""
        out = [flat[o : o + n] for o, n in zip(self.offsets, self.numels)]
        return out if shapes is None else [v.view(s) for v, s in zip(out, shapes)]


class SegmentPacker:
    """Codes of several tensors laid end to end (tensor ``i``: ``lengths[i]`` codes of
    ``bits`` bits) packed into the bytes of each tensor's own :func:`pack_codes`,
    concatenated: ``nbytes == sum(packed_nbytes(n, bits))``, whatever the alignment.

    Where every tensor's codes fill whole bytes that is one ``pack_codes`` of all codes;
    otherwise each tensor's codes are spread to a multiple of 8 codes (zeros after them)
    and the bytes each tensor's own packing would not send are left out, through two
    index tables made once.

    >>> p = SegmentPacker([3, 5], 2)   # 1 + 2 bytes, as two separate pack_codes
    >>> codes = torch.tensor([1, 2, 3, 3, 2, 1, 0, 1], dtype=torch.uint8)
    >>> p.unpack(p.pack(codes)).tolist() == codes.tolist(), p.nbytes
    (True, 3)
    """

    def __init__(self, lengths: Sequence[int], bits: int) -> None:
        self.bits, self.count = bits, sum(lengths)
        self.nbytes = sum(packed_nbytes(n, bits) for n in lengths)
        self.aligned = all(n * bits % 8 == 0 for n in lengths)
        self._tables: dict[str, tuple[Tensor, Tensor]] = {}
        self._lengths = tuple(lengths)

    def _index(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(codes -> place in the spread stream, kept byte -> place in its packing)."""
        key = str(device)
        if key not in self._tables:
            dst, keep, code_at, byte_at = list[int](), list[int](), 0, 0
            for n in self._lengths:
                dst += range(code_at, code_at + n)
                keep += range(byte_at, byte_at + packed_nbytes(n, self.bits))
                code_at += -(-n // 8) * 8
                byte_at += -(-n // 8) * self.bits
            self._tables[key] = (torch.tensor(dst, device=device),
                                 torch.tensor(keep, device=device))
        return self._tables[key]

    @property
    def _spread(self) -> int:
        return sum(-(-n // 8) * 8 for n in self._lengths)

    def pack(self, codes: Tensor) -> Tensor:
        """``codes`` (``count`` uint8, each < ``2**bits``) -> ``nbytes`` packed bytes."""
        codes = codes.reshape(-1)
        if self.aligned:
            return pack_codes(codes, self.bits)
        dst, keep = self._index(codes.device)
        stream = codes.new_zeros(self._spread).index_copy_(0, dst, codes)
        return pack_codes(stream, self.bits).index_select(0, keep)

    def unpack(self, packed: Tensor) -> Tensor:
        """Inverse of :meth:`pack`: the ``count`` uint8 codes."""
        if self.aligned:
            return unpack_codes(packed, self.bits, self.count)
        dst, keep = self._index(packed.device)
        full = packed.new_zeros(self._spread * self.bits // 8).index_copy_(0, keep, packed)
        return unpack_codes(full, self.bits, self._spread).index_select(0, dst)
