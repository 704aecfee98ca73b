"""Whole-bucket encode and decode of the chunked quantizers (``minmax8``, ``minmax4``,
``qsgd``): per-tensor chunks, one pass structure for any number of tensors.

Each tensor keeps its own chunks (the last one short), as ``compress`` cuts it alone: the
chunks become the rows of one padded matrix (:mod:`hexagram.compress.seg_rows`), so the
statistics of all chunks are one row reduction, the codes one broadcast pass, compacted
back to buffer order and packed over the whole buffer.

Segmented wire format (``S`` tensors of ``n_i`` elements, ``N = sum n_i``): the header of
every tensor's chunks in tensor order (``sum ceil(n_i / c)`` rows, as the per-tensor
headers concatenated), then the ``N`` codes of the buffer packed together
(``ceil(N * bits / 8)`` bytes, at most the per-tensor total). The decoded values equal
the per-tensor ones bit for bit (``minmax``; ``qsgd``: the same scales, fresh draws).

The CPU keeps the per-tensor path's host-read decisions (the fused min-max form, float64
for chunks whose range overflows): where tensors of one bucket decide differently (never
for ordinary gradients) it compresses them one by one and merges the payloads.

Example:
    >>> import torch, hexagram.compress as hc
    >>> from hexagram.compress.segments import Segments
    >>> c, seg = hc.get("minmax8"), Segments.of([3, 2])
    >>> p = c.compress_segments(torch.tensor([0.0, 1.0, 2.0, -4.0, 4.0]), seg)
    >>> p.nbytes, c.decompress_segments_into(p, torch.empty(5)).tolist()
    (21, [0.0, 0.9960784912109375, 2.0, -4.0, 4.0])
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from hexagram.compress import kernels
from hexagram.compress.base import Payload, check_compressible, ensure_finite
from hexagram.compress.chunks import halves, robust_norms, rounds_as_torch, work_dtype
from hexagram.compress.codes import stochastic_codes, truncate_to
from hexagram.compress.packing import cpu_fast, pack_codes, packed_nbytes, unpack_codes
from hexagram.compress.seg_rows import RowLayout, compact, expand_rows, padded, row_layout
from hexagram.compress.segments import Segments

__all__ = ["QuantizerLike", "check_segments", "chunk_norms", "decode_packed", "decode_rows",
           "merge_parts", "minmax_decode", "minmax_encode", "qsgd_decode", "qsgd_encode",
           "split_parts"]


class QuantizerLike(Protocol):
    """What these functions read of their compressor (minmax8/4, qsgd): a protocol rather
    than the classes, which import this module (no import circle)."""

    @property
    def name(self) -> str: ...
    @property
    def bits(self) -> int: ...
    @property
    def config(self) -> Any: ...
    @property
    def checks_finite(self) -> bool: ...

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None
                 ) -> Payload: ...

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor: ...


def check_segments(flat: Tensor, segments: Segments, who: str) -> Tensor:
    """``flat`` detached, after checking it is a compressible 1-D buffer of
    ``segments.numel`` elements."""
    check_compressible(flat, who)
    if flat.dim() != 1 or flat.numel() != segments.numel:
        raise ValueError(f"{who}: compress_segments takes the 1-D buffer of "
                         f"{segments.numel} elements its segments tile, got shape "
                         f"{tuple(flat.shape)}; flatten the bucket (or build its Segments)")
    return flat.detach()


def _payload(header: Tensor, codes: Tensor, flat: Tensor, segments: Segments) -> Payload:
    return Payload(tensors=(header, codes), shape=torch.Size([segments.numel]),
                   dtype=flat.dtype, meta={"segments": segments})


def merge_parts(parts: list[Payload], bits: int, flat: Tensor, segments: Segments) -> Payload:
    """The segmented payload of per-tensor payloads ``(header, packed codes)``: headers
    concatenated, codes repacked over the whole buffer (the CPU's rare cases)."""
    codes = torch.cat([unpack_codes(p.tensors[1], bits, n)
                       for p, n in zip(parts, segments.lengths)])
    return _payload(torch.cat([p.tensors[0] for p in parts]), pack_codes(codes, bits), flat,
                    segments)


def split_parts(payload: Payload, bits: int, seg_rows: tuple[int, ...]) -> list[Payload]:
    """The per-tensor payloads a segmented one was merged from (:func:`merge_parts`)."""
    segments: Segments = payload.meta["segments"]
    header, packed = payload.tensors
    codes = unpack_codes(packed, bits, segments.numel)
    heads = header.split(list(seg_rows))
    return [Payload(tensors=(h, pack_codes(codes[o:o + n], bits)), shape=torch.Size([n]),
                    dtype=payload.dtype)
            for h, o, n in zip(heads, segments.offsets, segments.lengths)]


def decode_rows(codes: Tensor, rows: Tensor, layout: RowLayout, out: Tensor, add: bool,
                levels: int | None = None) -> Tensor:
    """``out`` := (``add``: ``+=``) ``code * rows[r, 0] + rows[r, 1]`` (``* rows[r, 2]``
    when ``rows`` has three columns) of each element's row ``r``, in ``rows.dtype``;
    ``levels``: ``(code - levels) * rows[r, 0]`` instead. The per-tensor decoders' ops, so
    their bits."""
    per = expand_rows(rows, layout)  # (N, k)
    buf = codes.to(rows.dtype)
    if levels is not None:
        buf.sub_(levels).mul_(per[:, 0])
    else:
        buf.mul_(per[:, 0]).add_(per[:, 1])
        if rows.shape[1] > 2:
            buf.mul_(per[:, 2])
    if add:
        return out.add_(buf if buf.dtype == out.dtype else buf.to(out.dtype))
    return out.copy_(buf)


def decode_packed(packed: Tensor, bits: int, rows: Tensor, layout: RowLayout, out: Tensor,
                  add: bool, levels: int | None = None) -> Tensor:
    """:func:`decode_rows` of the ``bits``-bit codes packed in ``packed``: off the CPU's
    fast paths one fused kernel where :func:`kernels.dispatch` allows (each chunk's row
    values as the kernel's per-chunk ones; gathered per element where the layout pads),
    else unpacked and decoded eagerly."""
    n = out.numel()
    if cpu_fast(out) or out.dim() != 1 or packed.numel() != packed_nbytes(n, bits) or \
            (levels is not None and rows.dtype != out.dtype) or \
            rows.dtype not in (torch.float32, torch.float64) or not rounds_as_torch(out) or \
            not kernels.dispatch(packed, out):
        return decode_rows(unpack_codes(packed, bits, n), rows, layout, out, add, levels)
    # identity: element i lies in row i // chunk; else one row value per element (chunk 1)
    chunk = layout.chunk if layout.identity else 1
    cols = [rows[:, j] if layout.identity else rows[:, j].index_select(0, layout.row_of)
            for j in range(rows.shape[1])]
    if levels is not None:  # (code - levels) * k: the levels by table, exact
        values = torch.arange(-levels, (1 << bits) - levels, dtype=out.dtype,
                              device=out.device)
        return kernels.decode_table(packed, bits, n, values, out, add, chunk, cols[0])
    return kernels.decode_affine(packed, bits, n, chunk, cols[0], cols[1], out.dtype, out,
                                 add, post=cols[2] if len(cols) > 2 else None)


def minmax_encode(comp: QuantizerLike, flat: Tensor, segments: Segments) -> Payload:
    """:meth:`QuantizerLike.compress` of every segment, as one payload."""
    c, bits, wd = comp.config.chunk_size, comp.bits, work_dtype(flat.dtype)
    layout = row_layout(segments, c, flat.device)
    rows = padded(flat, layout, zero=False)  # padding repeats a real element: same min/max
    if not cpu_fast(flat) and kernels.dispatch(rows):  # every padded row is a chunk
        header, codes = kernels.minmax_encode(rows.view(-1), c, bits, packed=layout.identity)
        if comp.checks_finite:  # NaN/Inf make their chunk's header row non-finite
            ensure_finite(flat, header, comp.name)
        if not layout.identity:
            codes = pack_codes(compact(codes, layout), bits)
        return _payload(header, codes, flat, segments)
    ext = torch.stack([rows.amin(1), rows.amax(1)], 1).to(wd)
    if comp.checks_finite:
        ensure_finite(flat, ext, comp.name)
    lo, hi = ext[:, 0], ext[:, 1]
    step = (hi / 2 - lo / 2) / (((1 << bits) - 1) / 2)
    inv = torch.where(step > 0, 1 / step, 0.0)
    inv = torch.where(torch.isfinite(inv), inv, 0.0)
    if cpu_fast(flat):
        values = _minmax_cpu(rows, lo, hi, inv, layout)
        if values is None:  # a chunk's range overflows: per tensor, in float64 there
            return merge_parts([comp.compress(v) for v in segments.views(flat)], bits, flat,
                               segments)
    else:  # _minmax_codes_device's ops, per row
        factor, _ = halves(~torch.isfinite(hi - lo), lo.dtype)
        values = rows * factor[:, None]
        values.sub_((lo * factor)[:, None]).mul_((inv / factor)[:, None]).add_(0.5)
    codes = torch.empty(values.numel(), dtype=torch.uint8, device=flat.device)
    ints = torch.empty(0 if cpu_fast(flat) else values.numel(), dtype=torch.int32,
                       device=flat.device)
    truncate_to(codes, values.view(-1), ints)
    return _payload(torch.stack([lo, step], 1), pack_codes(compact(codes, layout), bits),
                    flat, segments)


def _minmax_cpu(rows: Tensor, lo: Tensor, hi: Tensor, inv: Tensor, layout: RowLayout
                ) -> Tensor | None:
    """``(x - lo) * inv + 0.5`` per row, fused as ``x * inv + (0.5 - lo * inv)`` in the
    tensors where ``_minmax_codes`` fuses it (every chunk within 64 ranges of 0); None
    where a chunk's range overflows (the per-tensor path then works in float64)."""
    if not bool(torch.isfinite(hi - lo).all()):
        return None
    ok = (torch.maximum(lo.abs(), hi.abs()) <= 64 * (hi - lo)).int()
    ends = torch.tensor(layout.seg_rows).cumsum(0) - 1
    bad = torch.diff(ok.cumsum(0)[ends], prepend=ok.new_zeros(1)) != torch.tensor(
        layout.seg_rows)  # segments with a chunk that may not fuse
    fused_row = (~bad).repeat_interleave(torch.tensor(layout.seg_rows))
    exact = None
    if not bool(fused_row.all()):
        exact = rows.to(lo.dtype, copy=True)
        exact.sub_(lo[:, None]).mul_(inv[:, None]).add_(0.5)
    if not bool(fused_row.any()):
        return exact
    fused = rows * inv[:, None]
    fused.add_((0.5 - lo * inv)[:, None])
    return fused if exact is None else torch.where(fused_row[:, None], fused, exact)


def minmax_decode(comp: QuantizerLike, payload: Payload, out: Tensor, add: bool
                  ) -> Tensor:
    """:meth:`QuantizerLike.decompress_into` of every segment of ``payload``."""
    segments: Segments = payload.meta["segments"]
    layout = row_layout(segments, comp.config.chunk_size, out.device)
    header, packed = payload.tensors
    _check_rows(header, layout, comp.name)
    lo, step = header[:, 0], header[:, 1]
    wide = ~torch.isfinite(step * ((1 << comp.bits) - 1))  # chunks spanning beyond the range
    if cpu_fast(packed) and bool(wide.any()):  # the CPU decodes those tensors in float64
        for part, view in zip(split_parts(payload, comp.bits, layout.seg_rows),
                              segments.views(out)):
            comp.decompress_into(part, view, add)
        return out
    if cpu_fast(packed):
        codes = unpack_codes(packed, comp.bits, segments.numel)
        return decode_rows(codes, torch.stack([step, lo], 1), layout, out, add)
    factor, post = halves(wide, step.dtype)
    rows = torch.stack([step * factor, lo * factor, post], 1)
    return decode_packed(packed, comp.bits, rows, layout, out, add)


def _check_rows(header: Tensor, layout: RowLayout, who: str) -> None:
    if header.shape[0] != layout.rows:
        raise ValueError(f"{who}: payload has {header.shape[0]} chunk headers, expected "
                         f"{layout.rows} for these segments; was it compressed with another "
                         "chunk size or another bucket layout?")


def chunk_norms(flat: Tensor, chunk: int, dtype: torch.dtype, who: str, check: bool
                ) -> Tensor:
    """:func:`~hexagram.compress.chunks.robust_norms` of ``flat``'s chunks, the short last
    one padded with zeros to a whole chunk: the norms :func:`qsgd_encode` takes from its
    padded rows, bit for bit (a row's reduction does not depend on the rows beside it)."""
    n = flat.numel()
    full = n - n % chunk
    if full == n:
        return robust_norms(flat, chunk, dtype, who, check)
    tail = flat.new_zeros(chunk)
    tail[: n - full] = flat[full:]
    norms = robust_norms(tail, chunk, dtype, who, check)
    return torch.cat([robust_norms(flat[:full], chunk, dtype, who, check), norms]) if full \
        else norms


def qsgd_encode(comp: QuantizerLike, flat: Tensor, segments: Segments,
                gen: torch.Generator) -> Payload:
    """:meth:`QuantizerLike.compress` of every segment, as one payload: the same norms
    (per-tensor buckets), codes drawn for the whole buffer at once."""
    d, s, wd = comp.config.bucket_size, comp.config.levels, work_dtype(flat.dtype)
    layout = row_layout(segments, d, flat.device)
    rows = padded(flat, layout, zero=True).reshape(-1)
    norms = robust_norms(rows, d, wd, comp.name, check=comp.checks_finite)
    if comp.checks_finite and not bool(torch.isfinite(norms).all()):
        raise ValueError(f"{comp.name}: a bucket's L2 norm exceeds the {wd} range; "
                         "scale the tensor down (e.g. divide by the world size) first")
    scale = torch.where(norms > 0, s / norms.double(), 0.0)
    if not cpu_fast(flat):  # s / norm beyond wd (subnormal norms): x * 2**64 first
        pre = torch.where(scale > torch.finfo(wd).max, 2.0**64, 1.0)
        codes = stochastic_codes(rows, d, (scale / pre).to(wd), s, gen, pre.to(wd),
                                 packed=False)
    elif bool((scale <= torch.finfo(wd).max).all()):
        codes = stochastic_codes(rows, d, scale.to(wd), s, gen, packed=False)
    else:  # the CPU computes those tensors in float64
        return merge_parts([comp.compress(v, gen) for v in segments.views(flat)],
                           comp.bits, flat, segments)
    return _payload(norms, pack_codes(compact(codes, layout), comp.bits), flat, segments)


def qsgd_decode(comp: QuantizerLike, payload: Payload, out: Tensor, add: bool) -> Tensor:
    """:meth:`QuantizerLike.decompress_into` of every segment of ``payload``."""
    segments: Segments = payload.meta["segments"]
    layout = row_layout(segments, comp.config.bucket_size, out.device)
    norms, packed = payload.tensors
    _check_rows(norms, layout, comp.name)
    s = comp.config.levels
    if comp.bits in (2, 4) and out.dtype == norms.dtype:  # the table path's (code - s) * k
        return decode_packed(packed, comp.bits, (norms / s)[:, None], layout, out, add,
                             levels=s)
    return decode_packed(packed, comp.bits, torch.stack([norms / s, -norms], 1), layout, out,
                         add)
