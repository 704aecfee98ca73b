"""Per-chunk helpers shared by the chunked quantizers (``minmax8``, ``qsgd``).

A flat tensor of ``n`` elements is cut into ``ceil(n / c)`` chunks of ``c`` elements (the
last one may be shorter); each chunk gets its own scale. These helpers compute per-chunk
reductions without copying the tensor, and apply per-chunk scales to a block in place
through (rows, c) views of its chunk-aligned pieces.

Example:
    >>> import torch
    >>> chunk_reduce(torch.arange(5.0), 2, lambda rows: rows.amax(dim=1))
    tensor([1., 3., 4.])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from hexagram.compress import kernels
from hexagram.compress.base import Compressor, Payload, decompress_via_into, ensure_finite
from hexagram.compress.packing import (
    block_size,
    blocks,
    byte_codes,
    cpu_fast,
    decode_blocks,
    packed_nbytes,
)

__all__ = [
    "TableCodedCompressor",
    "affine_rows",
    "chunk_reduce",
    "code_values",
    "decode_affine",
    "decode_table",
    "fma_rows",
    "halves",
    "padded_rows",
    "pieces",
    "robust_norms",
    "rounds_as_torch",
    "work_dtype",
]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic and header dtype: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def padded_rows(tensor: Tensor, chunks: int, chunk: int, dtype: torch.dtype) -> Tensor:
    """(chunks, chunk) copy of ``tensor``'s elements in ``dtype``, the last row padded with
    zeros (the per-chunk top-k compressors select within each row).

    >>> padded_rows(torch.arange(5.0), 2, 3, torch.float32).tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]
    """
    rows = torch.zeros(chunks * chunk, dtype=dtype, device=tensor.device)
    rows[: tensor.numel()].copy_(tensor.detach().reshape(-1))
    return rows.view(chunks, chunk)


def chunk_reduce(flat: Tensor, chunk: int, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``fn`` applied to the (rows, c) view of the full chunks and to the short last chunk.

    ``fn`` maps a (rows, c) tensor to a (rows, ...) tensor; results are concatenated in
    chunk order, so the output has ``ceil(n / chunk)`` rows.
    """
    n = flat.numel()
    full = n // chunk
    parts = []
    if full:
        parts.append(fn(flat[: full * chunk].view(full, chunk)))
    if n % chunk:
        parts.append(fn(flat[full * chunk :].view(1, n - full * chunk)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def pieces(start: int, length: int, chunk: int) -> list[tuple[int, int, int, int]]:
    """Chunk-aligned pieces of the block ``[start, start + length)`` of a flat tensor.

    Returns ``(offset, rows, cols, first_chunk)`` tuples: the block's elements
    ``[offset, offset + rows * cols)`` form a (rows, cols) view whose row ``i`` lies in
    chunk ``first_chunk + i``. A block that starts and ends on chunk boundaries is one
    piece; otherwise a partial head and/or tail chunk adds a one-row piece.
    """
    out = []
    pos, end = start, start + length
    while pos < end:
        chunk_start = pos // chunk * chunk
        if pos > chunk_start or end - pos < chunk:  # partial chunk: one row
            cols = min(end, chunk_start + chunk) - pos
            out.append((pos - start, 1, cols, pos // chunk))
            pos += cols
        else:  # whole chunks
            rows = (end - pos) // chunk
            out.append((pos - start, rows, chunk, pos // chunk))
            pos += rows * chunk
    return out


def affine_rows(buf: Tensor, start: int, chunk: int, *, sub: Tensor | None = None,
                mul: Tensor | None = None, add: Tensor | None = None) -> None:
    """In place, per chunk: ``buf[i] = (buf[i] - sub[c]) * mul[c] + add[c]``.

    ``c`` is the chunk of element ``start + i``; each of ``sub``, ``mul``, ``add`` holds one
    value per chunk (or is None: skipped).
    """
    for off, rows, cols, first in pieces(start, buf.numel(), chunk):
        view = buf[off : off + rows * cols].view(rows, cols)
        for op, per_chunk in ((view.sub_, sub), (view.mul_, mul), (view.add_, add)):
            if per_chunk is not None:
                op(per_chunk[first : first + rows, None])


def fma_rows(dst: Tensor, src: Tensor, start: int, chunk: int, mul: Tensor,
             add: Tensor | None) -> None:
    """Per chunk, in one pass: ``dst[i] = src[i] * mul[c] + add[c]`` (``add`` None: 0).

    ``dst`` may be ``src`` itself; ``src`` may have another dtype (e.g. the input tensor,
    read without a copy).
    """
    for off, rows, cols, first in pieces(start, dst.numel(), chunk):
        d = dst[off : off + rows * cols].view(rows, cols)
        s = src[off : off + rows * cols].view(rows, cols)
        # mul then add_: 3x faster than addcmul, whose broadcast path is not vectorized
        torch.mul(s, mul[first : first + rows, None], out=d)
        if add is not None:
            d.add_(add[first : first + rows, None])


def decode_affine(packed: Tensor, bits: int, n: int, chunk: int, scale: Tensor,
                  offset: Tensor | None, dtype: torch.dtype, out: Tensor | None = None,
                  add: bool = False, post: Tensor | None = None) -> Tensor:
    """Dense ``code * scale[chunk] + offset[chunk]`` of ``n`` packed codes (times
    ``post[chunk]`` when given).

    ``scale`` and ``offset`` hold one value per chunk (``expand`` a single value for a
    per-tensor scale); arithmetic runs block by block in ``scale.dtype``. The result is
    written into ``out`` (1-D, ``n`` elements of ``dtype``; allocated when None), or added
    to it with ``add``; returns ``out``. ``post`` lets the device decode chunks whose
    values would overflow ``scale.dtype`` as ``2 * (code * scale / 2 + offset / 2)`` (a
    power of two: exact) without reading which chunks those are (:func:`halves`).
    Off the CPU's fast paths, one fused kernel where :func:`kernels.dispatch` allows.
    """
    if out is None:
        out = torch.empty(n, dtype=dtype, device=packed.device)
    if scale.dtype in (torch.float32, torch.float64) and _fused(packed, bits, n, out, scale,
                                                                 offset, post):
        return kernels.decode_affine(packed, bits, n, chunk, scale, offset, dtype, out, add,
                                     post)
    direct = out.dtype == scale.dtype and not add  # decode in the output, no temporary
    block = block_size(packed.device)
    tmp = torch.empty(0 if direct else min(block, n), dtype=scale.dtype, device=packed.device)

    def use(start: int, stop: int, codes: Tensor) -> None:
        buf = out[start:stop] if direct else tmp[: stop - start]
        buf.copy_(codes)
        fma_rows(buf, buf, start, chunk, scale, offset)
        if post is not None:
            fma_rows(buf, buf, start, chunk, post, None)
        if add:  # round to out's dtype first: the same sum as out + decompress(...)
            out[start:stop].add_(buf if buf.dtype == out.dtype else buf.to(out.dtype))
        elif not direct:
            out[start:stop].copy_(buf)

    decode_blocks(packed, bits, n, use, block)
    return out


def halves(wide: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per-chunk ``(factor, post)``: (0.5, 2) where ``wide`` (the chunk's values overflow
    ``dtype`` in some intermediate), else (1, 1): scaling by a power of two is exact, so
    the other chunks keep their bits, and the device never reads which chunks are wide."""
    factor = torch.where(wide, 0.5, 1.0).to(dtype)
    return factor, torch.where(wide, 2.0, 1.0).to(dtype)


def code_values(bits: int, scale: Tensor, offset: Tensor, dtype: torch.dtype) -> Tensor:
    """``code * scale + offset`` for every code of ``bits`` bits (one-element ``scale`` and
    ``offset``, computed in their dtype as :func:`decode_affine` does), cast to ``dtype``."""
    codes = torch.arange(1 << bits, dtype=scale.dtype, device=scale.device)
    return (codes * scale.reshape(-1)[0] + offset.reshape(-1)[0]).to(dtype)


def decode_table(packed: Tensor, bits: int, n: int, values: Tensor, out: Tensor,
                 add: bool = False, chunk: int = 0, scale: Tensor | None = None) -> Tensor:
    """``out`` (1-D, ``n``) := ``values[code]`` of ``n`` packed codes (``add``: ``+=``),
    times ``scale[c]`` of each element's chunk ``c`` when ``scale`` is given.

    For formats of 1, 2 or 4 bits: ``values`` (``2**bits``, ``out``'s dtype) maps every
    code; a (256, 8 // bits) table maps every packed *byte*, so a block decodes with one
    ``index_select`` of ``n * bits / 8`` rows, straight from the wire bytes (4-10x fewer
    passes than unpack + convert + scale). Per-chunk ``scale`` (QSGD's ``norm / s``, in
    ``out``'s dtype) costs one multiplication more. Returns ``out``. Off the CPU's fast
    paths, one fused kernel where :func:`kernels.dispatch` allows.
    """
    if _fused(packed, bits, n, out, values, scale, out):
        return kernels.decode_table(packed, bits, n, values, out, add, chunk, scale)
    per = 8 // bits
    # (256, per): the values of each byte's codes
    table = values[byte_codes(bits, values.device).long()]
    block = block_size(out.device)
    tmp = out.new_empty(min(block, n) + per) if add or n % per else out.new_empty(0)
    for start, stop in blocks(n, block):
        first, length = start * bits // 8, stop - start
        idx = packed[first : first + packed_nbytes(length, bits)].int()
        direct = not add and length % per == 0  # decode into out itself
        dst = out[start:stop] if direct else tmp[: idx.numel() * per]
        _lookup(table, idx, dst.view(-1, per))
        if scale is not None:
            fma_rows(dst[:length], dst[:length], start, chunk, scale, None)
        if add:
            out[start:stop].add_(dst[:length])
        elif not direct:
            out[start:stop].copy_(dst[:length])
    return out


def rounds_as_torch(out: Tensor) -> bool:
    """Whether the kernels round values into ``out``'s dtype as torch does: everywhere but
    bfloat16 in Triton's interpreter (CPU tensors), which truncates float32 to bfloat16
    where torch (and the compiled ``cvt.rn``) rounds to nearest."""
    return out.dtype != torch.bfloat16 or out.device.type == "cuda"


def _fused(packed: Tensor, bits: int, n: int, out: Tensor, values: Tensor,
           *per_chunk: Tensor | None) -> bool:
    """Whether a decoder takes its fused kernel: off the CPU's fast paths, dense 1-D
    ``packed`` (exactly the ``n`` codes' bytes) and ``out``, and the per-chunk tensors (and
    the value table or scale, ``values``) in one dtype (the kernels' contract; the eager
    code takes any other call)."""
    if cpu_fast(out) or out.dim() != 1 or packed.dim() != 1 \
            or packed.numel() != packed_nbytes(n, bits) or not rounds_as_torch(out):
        return False
    if any(t is not None and t.dtype != values.dtype for t in per_chunk):
        return False
    return kernels.dispatch(packed, out)


#: a dtype as wide as a table row of 8 or 16 bytes: index_select of single elements is up
#: to 3x faster than of rows (whose copy loop runs per row)
_WIDE = {8: torch.int64, 16: torch.complex128}


def _lookup(table: Tensor, idx: Tensor, dst: Tensor) -> None:
    """``dst`` (rows, per) := ``table[idx]`` (``table`` (256, per), ``idx`` int32)."""
    width = table.shape[1] * table.element_size()
    wide = _WIDE.get(width)
    if wide is not None and dst.storage_offset() * dst.element_size() % width == 0:
        torch.index_select(table.view(wide).view(-1), 0, idx, out=dst.view(wide).view(-1))
    else:
        torch.index_select(table, 0, idx, out=dst)


def robust_norms(flat: Tensor, chunk: int, dtype: torch.dtype, who: str,
                 check: bool = True) -> Tensor:
    """L2 norm of each chunk in ``dtype``, exact also where squares over/underflow.

    CPU: the fast norm squares in ``dtype``; chunks whose norm came out non-finite or below
    ``sqrt(tiny)`` (squares may have underflowed, e.g. values of 1e-30 in float32) are
    recomputed in float64 as ``max|x| * ||x / max|x|||``. Elsewhere (CUDA) nothing is
    read back: float32/16 values are squared in float64, whose range holds every square,
    and float64 values take the scaled form for every chunk.
    With ``check``, NaN or Inf in ``flat`` raise :class:`NonFiniteGradientError` (they make
    a norm non-finite, which triggers the full check); without, they give a NaN/Inf norm.
    """
    if not cpu_fast(flat):
        if dtype == torch.float64 or flat.dtype == torch.float64:
            norms = chunk_reduce(flat, chunk, _scaled_norms).to(dtype)
        else:
            norms = chunk_reduce(flat, chunk, lambda rows: torch.linalg.vector_norm(
                rows, dim=1, dtype=torch.float64)).to(dtype)
        if check:
            ensure_finite(flat, norms, who)
        return norms
    norms = chunk_reduce(flat, chunk,
                         lambda rows: torch.linalg.vector_norm(rows, dim=1, dtype=dtype))
    if check:
        ensure_finite(flat, norms, who)
    suspect = ~torch.isfinite(norms) | (norms < torch.finfo(dtype).tiny ** 0.5)
    if bool(suspect.any()):  # rare: all-zero, tiny or huge chunks
        full = flat.numel() // chunk
        idx = suspect[:full].nonzero().flatten()
        if idx.numel():
            norms[idx] = _scaled_norms(flat[: full * chunk].view(full, chunk)[idx]).to(dtype)
        if norms.numel() > full and bool(suspect[-1]):
            norms[-1:] = _scaled_norms(flat[full * chunk :].view(1, -1)).to(dtype)
    return norms


def _scaled_norms(rows: Tensor) -> Tensor:
    """Row norms of a (rows, c) tensor in float64, scaled by each row's max so squares of
    huge or tiny values neither overflow nor underflow."""
    rows = rows.to(torch.float64)
    peak = rows.abs().amax(dim=1, keepdim=True)
    unit = rows / torch.where(peak > 0, peak, 1.0)
    return peak.squeeze(1) * torch.linalg.vector_norm(unit, dim=1)


class TableCodedCompressor(Compressor):
    """Base of per-tensor formats whose codes decode through a value table (sign, 1-bit,
    EF-sign, TernGrad): subclasses implement :meth:`Compressor.code_table`; decoding (and
    adding into a buffer) goes straight from the packed bytes via :func:`decode_table`."""

    def code_table(self, payload: Payload) -> tuple[int, Tensor, Tensor] | None:
        raise NotImplementedError(f"{type(self).__name__} must implement code_table")

    def decompress(self, payload: Payload) -> Tensor:
        return decompress_via_into(self, payload)

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor:
        table = self.code_table(payload)
        if table is None:  # a subclass whose format has no single table overrides this
            raise NotImplementedError(f"{type(self).__name__}: this payload has no code table; "
                                      "override decompress_into")
        bits, values, packed = table
        return decode_table(packed, bits, out.numel(), values, out, add)
