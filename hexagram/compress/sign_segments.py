"""Whole-bucket encode and decode of the sign compressors (``sign``, ``efsign``,
``onebit``) and of per-segment value tables (``terngrad``).

The sign bits of all tensors of a bucket are packed over the whole buffer (one pass);
each tensor keeps its own header: rms (scaled ``sign``), mean |x| (``efsign``), the
halves' means (``onebit``), one per tensor from ``_foreach_norm`` reductions
(:mod:`hexagram.compress.sign_stats`), or per block of each tensor (``block``: the rows of
one padded matrix, :mod:`hexagram.compress.seg_rows`).

Segmented wire format (``S`` tensors, ``N`` elements): the per-tensor headers stacked
((S,) rms or mean |x|, (S, 2) onebit values; with ``block``, every tensor's block
headers in order) and ``ceil(N / 8)`` bytes of sign bits. Decoded values equal the
per-tensor ones bit for bit.

Example:
    >>> import torch, hexagram.compress as hc
    >>> from hexagram.compress.segments import Segments
    >>> c, seg = hc.get("efsign"), Segments.of([2, 3])
    >>> p = c.compress_segments(torch.tensor([1.0, -3.0, 2.0, 2.0, -2.0]), seg)
    >>> c.decompress_segments_into(p, torch.empty(5)).tolist()
    [2.0, -2.0, 2.0, 2.0, -2.0]
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from hexagram.compress.base import Payload, ensure_finite
from hexagram.compress.packing import cpu_fast, unpack_codes
from hexagram.compress.quantize_segments import decode_packed
from hexagram.compress.seg_rows import padded, row_layout
from hexagram.compress.segments import Segments
from hexagram.compress.sign_bits import encode_signs
from hexagram.compress.sign_blocks import blocked_rows, check_header, row_header
from hexagram.compress.sign_stats import abs_means, header_of, onebit_means, rms

__all__ = ["SignLike", "decode_tables", "scaled_sign_decode", "scaled_sign_encode", "sign_encode"]


class SignLike(Protocol):
    """What these functions read of their compressor (sign, efsign, onebit): a protocol
    rather than the classes, which import this module (no import circle)."""

    @property
    def name(self) -> str: ...
    @property
    def config(self) -> Any: ...
    @property
    def checks_finite(self) -> bool: ...


def sign_encode(comp: SignLike, flat: Tensor, segments: Segments) -> tuple[Tensor, ...]:
    """The payload tensors of ``sign`` for the segments of ``flat``: ``(bits,)``, or
    ``(rms per segment, bits)`` when ``scaled``."""
    check = comp.checks_finite
    bits, _ = encode_signs(flat, comp.name, stats=False, check=check and not comp.config.scaled)
    if not comp.config.scaled:
        return (bits,)
    values = rms(flat, segments)
    if check:  # NaN and Inf propagate through norms
        ensure_finite(flat, values, comp.name)
    return header_of(values, flat.dtype, comp.name, check), bits


def scaled_sign_encode(comp: SignLike, flat: Tensor, segments: Segments
                       ) -> tuple[Tensor, Tensor]:
    """``(header, bits)`` of ``efsign`` / ``onebit`` for the segments of ``flat``: headers
    (S,) / (S, 2), or every segment's blocks' with ``config.block``."""
    check = comp.checks_finite
    bits, _ = encode_signs(flat, comp.name, stats=False, check=check and bool(comp.config.block))
    if comp.config.block:
        layout = row_layout(segments, comp.config.block, flat.device)
        header = row_header(padded(flat, layout, zero=True), layout.sizes, comp.name,
                            flat.dtype)
        if check:
            check_header(header, comp.name)
        return header, bits
    values = abs_means(flat, segments) if comp.name == "efsign" else onebit_means(flat, segments)
    if check:  # NaN and Inf propagate through the sums
        ensure_finite(flat, values, comp.name)
    return header_of(values, flat.dtype, comp.name, check), bits


def scaled_sign_decode(comp: SignLike, payload: Payload, out: Tensor,
                       add: bool) -> Tensor:
    """Decode a segmented ``efsign`` / ``onebit`` payload into ``out`` (``add``: +=)."""
    segments: Segments = payload.meta["segments"]
    header, packed = payload.tensors
    if comp.config.block:
        layout = row_layout(segments, comp.config.block, out.device)
        if header.shape[0] != layout.rows:
            raise ValueError(f"{comp.name}: payload has {header.shape[0]} block headers, "
                             f"expected {layout.rows} for these segments; was it compressed "
                             "with another block size or bucket layout?")
        rows = blocked_rows(header, comp.name, not cpu_fast(out))
        return decode_packed(packed, 1, rows, layout, out, add)
    bits = unpack_codes(packed, 1, segments.numel)
    h = header.reshape(len(segments), -1)
    # the per-tensor code tables: efsign [-s, s] (exact), onebit [neg, pos]
    tables = torch.cat([-h, h], 1) if comp.name == "efsign" else h
    return decode_tables(tables.to(out.dtype), bits, 1, segments, out, add)


def decode_tables(tables: Tensor, codes: Tensor, bits: int, segments: Segments, out: Tensor,
                  add: bool) -> Tensor:
    """``out`` := (``add``: +=) ``tables[i, code]`` for each element of segment ``i``
    (``tables``: (S, 2**bits) in ``out``'s dtype, ``codes``: (N,) uint8 unpacked): one
    index computation and one gather, whatever the number of segments. Eager on every
    device: the fused decoders take one table for the whole buffer (times a per-chunk
    scale, which would round differently from a table of products, e.g. 16-bit
    subnormals)."""
    if tables.shape != (len(segments), 1 << bits):
        raise ValueError(f"expected ({len(segments)}, {1 << bits}) code tables, got "
                         f"{tuple(tables.shape)}; was the payload compressed for another "
                         "bucket layout?")
    index = torch.add(codes, segments.index(out.device), alpha=1 << bits)
    values = tables.reshape(-1).index_select(0, index)
    return out.add_(values) if add else out.copy_(values)
