"""The chunked top-k format over many tensors at once (SparseLoCo's outer step).

:class:`ChunkTopKRows` encodes a flat buffer laid out by
:class:`~hexagram.compress.chunk_rows.ChunkRows` (every tensor cut into the chunks
:class:`~hexagram.compress.chunk_topk.ChunkTopKCompressor` would cut it into) with one
top-k and one quantizer per row format instead of one per tensor, into ONE payload. Per
chunk the format is the compressor's own (same ``k``, same bits, same bin means, the same
bits of output: rows are independent); the payload is, per row format, the bin means,
the value codes and the positions, each packed as the per-tensor payloads pack them
(:class:`~hexagram.compress.chunk_rows.SegmentPacker`), so its ``nbytes`` equals the sum
of the per-tensor payloads'.

The encode also returns what the payload carries, decoded (positions and values per row
format, zero where a position is padding): error feedback subtracts it from the buffer it
encoded and the sender adds it to the sum of the ranks' updates, without unpacking its own
payload again. A payload received from a peer is decoded with :meth:`ChunkTopKRows.decode`
(positions clamped into the row, values of padding positions zeroed: no index a peer sends
can write outside the buffer), its malformed flags handed to the caller on the device.

Example:
    >>> import torch
    >>> rows = ChunkTopKRows(ChunkTopKConfig(chunk=4, density=0.5, bits=2), [6, 3],
    ...                      torch.float32)
    >>> flat = torch.zeros(rows.layout.numel)
    >>> flat[:6], flat[8:] = torch.tensor([0.5, -4, 0, 1, 3, 0]), torch.tensor([0.0, 5, 1])
    >>> payload, sent, bad = rows.encode(flat)
    >>> out = torch.zeros_like(flat)
    >>> rows.add_into(out, rows.decode(payload)).tolist(), bool(bad)
    ([0.0, -4.0, 0.0, 1.0, 3.0, 0.0, 0.0, 0.0, 0.0, 5.0, 1.0], False)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hexagram.compress.base import Payload
from hexagram.compress.chunk_rows import ChunkRows, RowGroup, SegmentPacker
from hexagram.compress.chunk_topk import (
    ChunkTopKConfig,
    chunk_layout,
    code_values,
    quantize_rows,
)
from hexagram.compress.chunks import work_dtype
from hexagram.compress.faults import beyond, row_positions

__all__ = ["ChunkTopKRows", "PositionPacker", "Sparse"]


class PositionPacker:
    """Positions of ``bits`` bits (<= 16) of tensors of ``lengths`` kept entries, packed as
    :func:`~hexagram.compress.chunk_topk.pack_positions` packs each tensor's: ``bits <=
    8``: packed codes; else the low bytes of all, then the high ``bits - 8`` bits packed
    per tensor (the same byte count)."""

    def __init__(self, lengths: Sequence[int], bits: int) -> None:
        self.wide = bits > 8
        self.codes = SegmentPacker(lengths, bits - 8 if self.wide else bits)
        self.count = sum(lengths)
        self.nbytes = self.codes.nbytes + (self.count if self.wide else 0)

    def pack(self, pos: Tensor) -> list[Tensor]:
        if not self.wide:
            return [self.codes.pack(pos.to(torch.uint8))]
        low = (pos & 255).to(torch.uint8).reshape(-1)
        return [low, self.codes.pack((pos >> 8).to(torch.uint8))]

    def unpack(self, parts: Sequence[Tensor]) -> Tensor:
        """The ``count`` int64 positions of :meth:`pack`'s tensors."""
        if not self.wide:
            return self.codes.unpack(parts[0]).long()
        return parts[0].long() | (self.codes.unpack(parts[1]).long() << 8)

    @property
    def parts(self) -> int:
        return 2 if self.wide else 1


@dataclass
class Sparse:
    """A payload decoded: per row format, (rows, k) positions in the row (int64) and
    values (the work dtype, zero at padding positions)."""

    pos: list[Tensor]
    values: list[Tensor]


class ChunkTopKRows:
    """:class:`~hexagram.compress.chunk_topk.ChunkTopKCompressor`'s format over the chunks
    of tensors of ``numels`` (``dtype``: theirs), one payload for all (module doc)."""

    def __init__(self, config: ChunkTopKConfig, numels: Sequence[int], dtype: torch.dtype
                 ) -> None:
        self.config, self.dtype, self.work = config, dtype, work_dtype(dtype)
        self.layout = ChunkRows(numels, lambda n: chunk_layout(config, n))
        self._packers = [(SegmentPacker([c * g.k for c in g.counts], config.bits),
                          PositionPacker([c * g.k for c in g.counts], g.pos_bits))
                         for g in self.layout.groups]
        m, h = 1 << (config.bits - 1), torch.finfo(self.work).bits // 8
        #: wire bytes of a payload: those of the per-tensor payloads of the compressor
        self.nbytes = sum(g.rows * m * h + vp.nbytes + pp.nbytes
                          for g, (vp, pp) in zip(self.layout.groups, self._packers))

    def encode(self, flat: Tensor) -> tuple[Payload, Sparse, Tensor]:
        """``(payload, sent, nonfinite)`` of ``flat`` (this layout): ``sent`` what the
        payload carries, decoded; ``nonfinite`` a 0-dim bool tensor, True where ``flat``
        holds NaN or Inf (read nothing: the caller joins it to its one host read)."""
        bits, tensors, sent, peaks = self.config.bits, [], Sparse([], []), []
        for g, (vp, pp) in zip(self.layout.groups, self._packers):
            rows = g.view(flat)
            mags, pos, levels, codes = quantize_rows(rows.to(self.work), g.k, bits)
            peaks.append(mags[:, 0])  # NaN sorts first: a non-finite chunk shows here
            tensors += [levels, vp.pack(codes), *pp.pack(pos)]
            sent.pos.append(pos)
            sent.values.append(g.mask_padding(pos, code_values(levels, codes, bits)))
        peak = peaks[0] if len(peaks) == 1 else torch.cat(peaks)
        payload = Payload(tensors=tuple(tensors), shape=torch.Size([self.layout.numel]),
                          dtype=flat.dtype)
        return payload, sent, ~torch.isfinite(peak).all()

    def decode(self, payload: Payload, faults: list[Tensor] | None = None) -> Sparse:
        """Positions and values of a payload of this layout (a peer's, say). ``faults``:
        where the payload's malformed flags go (0-d bools, no host read: bin means
        NaN/Inf or past the dtype's range, a position past its chunk or repeated)."""
        out, parts = Sparse([], []), iter(payload.tensors)
        for g, (vp, pp) in zip(self.layout.groups, self._packers):
            levels, codes = next(parts), next(parts)
            packed = [next(parts) for _ in range(pp.parts)]
            _check(g, levels, codes, packed, vp, pp)
            pos = pp.unpack(packed).view(g.rows, g.k)
            values = code_values(levels, vp.unpack(codes).view(g.rows, g.k), self.config.bits)
            if faults is not None:
                faults += [beyond(levels, self.dtype), row_positions(pos, g.width)]
            if g.padded or g.width & (g.width - 1):  # a position may point past the data
                values = torch.where(pos < g.device_limits(pos.device), values, 0.0)
                pos = pos.clamp_(max=g.width - 1)
            out.pos.append(pos)
            out.values.append(values)
        return out

    def add_into(self, out: Tensor, sparse: Sparse, sign: float = 1.0) -> Tensor:
        """``out`` (a buffer of this layout) += ``sign`` * the dense tensor of ``sparse``,
        in place; returns ``out``. Positions are distinct in a row, so each element gets
        one float addition (the sum of several payloads is in the order of the calls)."""
        for g, pos, values in zip(self.layout.groups, sparse.pos, sparse.values):
            v = values.to(out.dtype)
            g.view(out).scatter_add_(1, pos, v.neg() if sign < 0 else v)
        return out


def _check(g: RowGroup, levels: Tensor, codes: Tensor, packed: list[Tensor],
           vp: SegmentPacker, pp: PositionPacker) -> None:
    """Refuse a payload of another layout or config by name (sizes are host facts)."""
    if (levels.shape[0], codes.numel(), sum(p.numel() for p in packed)) != \
            (g.rows, vp.nbytes, pp.nbytes):
        raise ValueError(f"chunktopk: payload does not match {g.rows} chunks of {g.width} "
                         f"with k={g.k}; was it compressed with another config or model?")
