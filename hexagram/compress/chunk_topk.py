"""Chunked top-k with quantized values: SparseLoCo's compressor.

The flat tensor of ``n`` elements is cut into ``G = ceil(n / c)`` chunks of ``c =
min(chunk, n)`` elements (the last one zero-padded); in each chunk the ``k = max(1,
round(density * c))`` entries of largest magnitude are kept, their values quantized to
``bits`` bits (deterministic), their positions in the chunk packed in ``b =
bit_length(c - 1)`` bits (at least 1): the fewest that can name every position of a chunk.

Value code (sign-magnitude, ``m = 2**(bits - 1)`` magnitude bins per chunk): bit ``bits -
1`` is the sign (1: negative), the low bits the bin ``j = min(floor(|v| m / s), m - 1)`` of
the magnitude on ``[0, s]``, ``s = max |kept|`` of the chunk. A bin decodes to the mean
magnitude of the chunk's kept values in it, sent per chunk (SparseLoCo's quantizer decodes
through the mean of each bin as well): no value is pushed to the top of its bin, and the
error of a bin sums to zero. ``bits = 1``: one bin, the sign scaled by the mean kept
magnitude. Every kept value is at least the chunk's k-th largest magnitude, so no zero
level is needed.

Wire format (``h`` = 4 bytes, 8 for float64 input):

- levels: (G, m) of ``h`` bytes;
- values: ``ceil(G k bits / 8)`` bytes (codes packed as ``pack_codes`` does);
- positions: ``ceil(G k b / 8)`` bytes: for ``b <= 8`` packed codes; for ``b`` in 9..16
  the ``G k`` low bytes, then the high ``b - 8`` bits packed.

``nbytes = h G m + ceil(G k bits / 8) + ceil(G k b / 8)``. Payloads do not sum
(``Aggregation.GATHER``): every rank decodes every rank's payload in rank order, so all
receive the same bits.

Example:
    >>> import torch
    >>> c = ChunkTopKCompressor(ChunkTopKConfig(chunk=8, density=0.25, bits=2))
    >>> x = torch.tensor([0.0, 4.0, 0.0, -1.0, 0.0, 0.0, 0.0, 1.5])
    >>> p = c.compress(x)   # 4 in the upper bin of [0, 4], 1.5 in the lower one
    >>> c.decompress(p).tolist(), p.nbytes   # 2 * 4 + 1 + 1 bytes
    ([0.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.5], 10)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hexagram.compress.base import (
    Aggregation,
    Compressor,
    Layout,
    Payload,
    check_compressible,
    decompress_via_into,
    ensure_finite,
)
from hexagram.compress.chunks import padded_rows, work_dtype
from hexagram.compress.faults import any_of, beyond, row_positions
from hexagram.compress.packing import pack_codes, packed_nbytes, unpack_codes
from hexagram.config import check_float, check_int

__all__ = ["ChunkTopKCompressor", "ChunkTopKConfig", "chunk_layout", "code_values",
           "pack_positions", "quantize_rows", "unpack_positions"]


@dataclass(frozen=True, kw_only=True)
class ChunkTopKConfig:
    """Settings of :class:`ChunkTopKCompressor`.

    Attributes:
        chunk: elements per chunk (at most 65536); larger => fewer scales, more position
            bits (``bit_length(chunk - 1)``), top-k over a wider window.
        density: fraction kept in each chunk; smaller => fewer bytes, more left to error
            feedback.
        bits: bits per kept value (1 to 8); fewer => fewer bytes, coarser values.
    """

    chunk: int = 4096
    density: float = 64 / 4096
    bits: int = 2

    def __post_init__(self) -> None:
        check_int(self, "chunk", low=1, high=1 << 16)
        check_float(self, "density", low=0.0, high=1.0, low_open=True)
        check_int(self, "bits", low=1, high=8)


def chunk_layout(config: ChunkTopKConfig, n: int) -> tuple[int, int, int, int]:
    """``(c, G, k, b)``: chunk length, chunks, kept per chunk and position bits of an
    ``n``-element tensor (see the module doc)."""
    c = min(config.chunk, n)
    k = max(1, min(c, round(config.density * c)))
    return c, -(-n // c), k, max(1, (c - 1).bit_length())


def pack_positions(pos: Tensor, bits: int) -> Tensor:
    """Positions in ``[0, 2**bits)`` (any integer dtype), ``bits`` <= 16, packed in
    ``ceil(len * bits / 8)`` bytes (see the module doc)."""
    pos = pos.reshape(-1)
    if bits <= 8:
        return pack_codes(pos.to(torch.uint8), bits)
    low = (pos & 255).to(torch.uint8)
    high = pack_codes((pos >> 8).to(torch.uint8), bits - 8)
    return torch.cat([low, high])


def unpack_positions(packed: Tensor, bits: int, count: int) -> Tensor:
    """Inverse of :func:`pack_positions`: ``count`` int64 positions."""
    if bits <= 8:
        return unpack_codes(packed, bits, count).long()
    low = packed[:count].long()
    return low | (unpack_codes(packed[count:], bits - 8, count).long() << 8)


def check_chunk_payload(name: str, matches: bool, chunks: int, chunk: int, k: int) -> None:
    """Raise ValueError unless a per-chunk top-k payload ``matches`` the layout of ``chunks``
    chunks of ``chunk`` keeping ``k`` each (the payload came from another config)."""
    if not matches:
        raise ValueError(f"{name}: payload does not match {chunks} chunks of {chunk} with "
                         f"k={k}; was it compressed with another config?")


def quantize_rows(rows: Tensor, k: int, bits: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The format's encode of a (rows, c) matrix (one chunk a row): ``(mags, pos, levels,
    codes)``, the (rows, k) kept magnitudes (largest first) and their positions in the
    row, the (rows, 2**(bits - 1)) bin means and the (rows, k) uint8 value codes.

    The one implementation of the per-chunk quantizer: :class:`ChunkTopKCompressor` runs
    it on one tensor's chunks, :mod:`hexagram.compress.chunk_topk_flat` on the chunks of
    many tensors at once (rows are independent, so both give the same bits)."""
    mags, pos = rows.abs().topk(k, dim=1)  # (G, k); sorted: deterministic order
    m = 1 << (bits - 1)
    inv = torch.where(mags[:, :1] > 0, m / mags[:, :1], 0.0)  # (G, 1): m / s
    level = (mags * inv).floor_().clamp_(0, m - 1).to(torch.uint8)  # (G, k) bins
    # mean magnitude per (chunk, bin): sums of a one-hot (G, k, m), no atomics, so the
    # same bits on every run and device
    onehot = level[..., None] == torch.arange(m, device=level.device, dtype=torch.uint8)
    counts = onehot.sum(1)  # (G, m)
    sums = (onehot * mags[..., None]).sum(1)
    levels = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0).contiguous()
    negative = rows.gather(1, pos) < 0
    return mags, pos, levels, level + negative.to(torch.uint8) * m


def code_values(levels: Tensor, codes: Tensor, bits: int) -> Tensor:
    """(rows, k) values of (rows, k) value ``codes`` under the bin means ``levels``."""
    m = 1 << (bits - 1)
    mag = levels.gather(1, (codes % m).long())  # each bin's mean magnitude
    return torch.where(codes >= m, -mag, mag)


class ChunkTopKCompressor(Compressor):
    """Top-k per chunk, values in ``bits`` bits with per-chunk scales (module doc)."""

    name = "chunktopk"
    aggregation = Aggregation.GATHER
    unbiased = False
    #: the padded copy (read, write), the magnitudes (write, read), the per-chunk top-k (a
    #: read) and the decode's zero fill
    memory_passes = 6.0

    def __init__(self, config: ChunkTopKConfig | None = None) -> None:
        self.config = config or ChunkTopKConfig()

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        check_compressible(tensor, self.name)
        n = tensor.numel()
        c, g, k, b = chunk_layout(self.config, n)
        rows = padded_rows(tensor, g, c, work_dtype(tensor.dtype))
        mags, pos, levels, codes = quantize_rows(rows, k, self.config.bits)
        if self.checks_finite:  # a host read (a standalone compressor's check)
            ensure_finite(tensor, mags[:, 0], self.name)  # NaN sorts first: non-finite
        return Payload(tensors=(levels, pack_codes(codes.reshape(-1), self.config.bits),
                                pack_positions(pos, b)),
                       shape=tensor.shape, dtype=tensor.dtype)

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        """:meth:`layout` of the ``prod(shape)`` elements (what the cost model reads)."""
        return self.layout(math.prod(shape), dtype)

    def layout(self, n: int, dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], torch.dtype],
                                                          ...]:
        """Shape and dtype of each payload tensor for ``n`` elements of ``dtype`` (the wire
        format of the module doc, without compressing anything)."""
        _, g, k, b = chunk_layout(self.config, n)
        return (((g, 1 << (self.config.bits - 1)), work_dtype(dtype)),
                ((packed_nbytes(g * k, self.config.bits),), torch.uint8),
                ((packed_nbytes(g * k, b),), torch.uint8))

    def values(self, payload: Payload) -> tuple[Tensor, Tensor]:
        """``(flat positions, values)`` of the kept entries, (G k,) each; positions index
        the zero-padded ``G c`` layout (those >= ``n`` are padding and hold zero-level
        magnitudes of no data)."""
        n = payload.shape.numel()
        c, g, k, b = chunk_layout(self.config, n)
        levels, packed, packed_pos = payload.tensors
        check_chunk_payload(self.name, levels.shape[0] == g and
                            packed_pos.numel() == packed_nbytes(g * k, b), g, c, k)
        codes = unpack_codes(packed, self.config.bits, g * k).view(g, k)
        vals = code_values(levels, codes, self.config.bits)
        base = torch.arange(g, device=levels.device)[:, None] * c
        # ``b`` bits can name more than ``c`` positions: clamped into the chunk (a payload
        # naming one is flagged by payload_fault), so no index leaves the output
        pos = unpack_positions(packed_pos, b, g * k).view(g, k).clamp_(max=c - 1) + base
        return pos.reshape(-1), vals.reshape(-1)

    def payload_fault(self, payload: Payload) -> Tensor:
        """Bin means NaN/Inf or past the dtype's range; a position past its chunk or
        repeated in it (no host read)."""
        c, g, k, b = chunk_layout(self.config, payload.shape.numel())
        levels, _, packed_pos = payload.tensors
        pos = unpack_positions(packed_pos, b, g * k).view(g, k)
        return any_of([beyond(levels, payload.dtype), row_positions(pos, c)])

    def decompress(self, payload: Payload) -> Tensor:
        return decompress_via_into(self, payload)

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor:
        n = payload.shape.numel()
        c, g, _, _ = chunk_layout(self.config, n)
        pos, vals = self.values(payload)
        if g * c == n:  # no padding: straight into out
            if not add:
                out.zero_()
            return out.index_put_((pos,), vals.to(out.dtype), accumulate=True)
        dense = torch.zeros(g * c, dtype=out.dtype, device=out.device)
        dense.index_put_((pos,), vals.to(out.dtype), accumulate=True)
        return out.add_(dense[:n]) if add else out.copy_(dense[:n])

    def __repr__(self) -> str:
        return f"ChunkTopKCompressor({self.config})"

