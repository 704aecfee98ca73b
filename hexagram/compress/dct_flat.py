"""The chunked DCT top-k format over many tensors at once (DeMo's exchange).

:class:`DCTTopKRows` is :class:`~hexagram.compress.dct.DCTTopKCompressor`'s format over a
flat buffer laid out by :class:`~hexagram.compress.chunk_rows.ChunkRows` (every tensor cut
into the chunks the compressor would cut it into, zero-padded): one transform (a matrix
product with the cached DCT-II matrix), one top-k and one gather per row format, ONE
payload; per chunk the same coefficients, the same wire values and, per row format, the
positions packed as the per-tensor payloads pack them, so ``nbytes`` equals the sum of the
per-tensor payloads'.

The inverse is linear: :meth:`DCTTopKRows.inverse` transforms the sum of several sparse
spectra (several ranks' payloads, added in rank order) back with one matrix product per
row format, instead of one per rank and tensor, and zeroes the padding.

Example:
    >>> import torch
    >>> rows = DCTTopKRows(DCTTopKConfig(chunk=4, k=4, wire_dtype="float32"), [6, 3],
    ...                    torch.float32)
    >>> flat = torch.zeros(rows.layout.numel)
    >>> flat[:6], flat[8:] = torch.arange(6.0), torch.ones(3)
    >>> payload, sent = rows.encode(flat)
    >>> [round(v, 4) + 0.0 for v in rows.inverse([rows.decode(payload)],
    ...                                         torch.empty_like(flat)).tolist()]
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 0.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hexagram.compress.base import Payload
from hexagram.compress.chunk_rows import ChunkRows
from hexagram.compress.chunk_topk_flat import PositionPacker, Sparse
from hexagram.compress.chunks import work_dtype
from hexagram.compress.dct import WIRE_DTYPES, DCTTopKConfig, dct_layout, dct_matrix
from hexagram.compress.faults import beyond, row_positions

__all__ = ["DCTTopKRows"]


class DCTTopKRows:
    """:class:`~hexagram.compress.dct.DCTTopKCompressor`'s format over the chunks of
    tensors of ``numels`` (``dtype``: theirs), one payload for all (module doc)."""

    def __init__(self, config: DCTTopKConfig, numels: Sequence[int], dtype: torch.dtype
                 ) -> None:
        self.config, self.work = config, work_dtype(dtype)
        self.wire = WIRE_DTYPES[config.wire_dtype]
        self.layout = ChunkRows(numels, lambda n: dct_layout(config, n))
        self._packers = [PositionPacker([c * g.k for c in g.counts], g.pos_bits)
                         for g in self.layout.groups]
        size = torch.finfo(self.wire).bits // 8
        #: wire bytes of a payload: those of the per-tensor payloads of the compressor
        self.nbytes = sum(g.rows * g.k * size + p.nbytes
                          for g, p in zip(self.layout.groups, self._packers))
        self._cols: dict[str, Tensor] = {}

    def encode(self, flat: Tensor) -> tuple[Payload, Sparse]:
        """``(payload, sent)`` of ``flat`` (this layout, zero padding): ``sent`` holds the
        kept positions and their values as the wire carries them (in the work dtype)."""
        tensors: list[Tensor] = []
        sent = Sparse([], [])
        for g, packer in zip(self.layout.groups, self._packers):
            rows = g.view(flat).to(self.work)
            spectrum = rows @ dct_matrix(g.width, flat.device, self.work).T  # (rows, c)
            pos = spectrum.abs().topk(g.k, dim=1)[1]  # sorted: a deterministic order
            values = spectrum.gather(1, pos).to(self.wire)
            tensors += [values, *packer.pack(pos)]
            sent.pos.append(pos)
            sent.values.append(values.to(self.work))
        return Payload(tensors=tuple(tensors), shape=torch.Size([self.layout.numel]),
                       dtype=flat.dtype), sent

    def decode(self, payload: Payload, faults: list[Tensor] | None = None) -> Sparse:
        """Positions and wire values of a payload of this layout (a peer's, say); positions
        past a row (``bit_length(c - 1)`` bits can name more than ``c``) are clamped and
        their values zeroed, so no peer's bytes write outside the spectrum. ``faults``:
        where the payload's malformed flags go (0-d bools, no host read: coefficients
        NaN/Inf or large enough to overflow the inverse transform, a position past its
        chunk or repeated in it)."""
        out, parts = Sparse([], []), iter(payload.tensors)
        for g, packer in zip(self.layout.groups, self._packers):
            values = next(parts)
            packed = [next(parts) for _ in range(packer.parts)]
            if values.shape != (g.rows, g.k) or sum(p.numel() for p in packed) != packer.nbytes:
                raise ValueError(f"dcttopk: payload does not match {g.rows} chunks of "
                                 f"{g.width} with k={g.k}; was it compressed with another "
                                 "config or model?")
            pos = packer.unpack(packed).view(g.rows, g.k)
            vals = values.to(self.work)
            if faults is not None:
                faults += [beyond(values, self.work, factor=g.k), row_positions(pos, g.width)]
            if g.width & (g.width - 1):
                vals = torch.where(pos < g.width, vals, 0.0)
                pos = pos.clamp_(max=g.width - 1)
            out.pos.append(pos)
            out.values.append(vals)
        return out

    def inverse(self, spectra: Sequence[Sparse], out: Tensor) -> Tensor:
        """``out`` (this layout) := the inverse transform of the sum of ``spectra`` (added
        in order), padding zero; returns ``out``."""
        for i, g in enumerate(self.layout.groups):
            spectrum = torch.zeros(g.rows, g.width, dtype=self.work, device=out.device)
            for s in spectra:
                spectrum.scatter_add_(1, s.pos[i], s.values[i])
            dense = spectrum @ dct_matrix(g.width, out.device, self.work)
            if g.padded:  # the transform spreads a chunk over its padding: cut it off
                dense.masked_fill_(self._columns(g.width, out.device) >= g.device_limits(
                    out.device), 0.0)
            g.view(out).copy_(dense)
        return out

    def _columns(self, width: int, device: torch.device) -> Tensor:
        """(1, width) column numbers on ``device`` (cached)."""
        key = f"{width}/{device}"
        if key not in self._cols:
            self._cols[key] = torch.arange(width, device=device).view(1, -1)
        return self._cols[key]
