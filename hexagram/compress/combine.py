"""Reducing P ranks' payloads in code space: one table lookup per element, not P passes.

For per-tensor formats of few bits (``sign``, ``efsign``, ``onebit``: 1 bit; ``terngrad``:
2 bits), rank r's element decodes to ``values_r[code]``. With ``bits * P <= 8`` the P codes
of an element fit in one index of ``bits * P`` bits, and a table of ``2**(bits * P)``
entries holds, for every combination, ``finish(values_0[c_0] + values_1[c_1] + ...)``
computed with the same float additions, in the same rank order, as decoding each payload
and adding it into the output: the result is bit-identical, but it costs byte operations
on the packed codes (a lookup that spreads each rank's byte into its bit slots, an or per
rank) and one lookup of the output, instead of P dense decodes and P - 1 float additions.

Example:
    >>> import torch, hexagram.compress as hc
    >>> c = hc.get("sign")
    >>> ps = [c.compress(torch.tensor(v)) for v in ([1.0, -1, 2], [-1.0, -2, 3], [1.0, 1, 1])]
    >>> sum_payloads(c, ps, torch.empty(3), lambda t: t.sign_()).tolist()
    [1.0, -1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from hexagram.compress.base import Compressor, Payload
from hexagram.compress.packing import block_size, blocks, byte_codes, packed_nbytes

__all__ = ["decode_sum", "sum_payloads"]


def decode_sum(compressor: Compressor, payloads: Sequence[Payload], out: Tensor,
               finish: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """``out`` (1-D) := ``finish(sum of the decoded payloads, in rank order)``; returns ``out``.

    The one decode-and-sum of the library (every collective that ends with several ranks'
    payloads calls it): in code space when :func:`sum_payloads` allows it, else each payload
    decoded and added straight into ``out`` (no dense temporary per rank). Both give the same
    bits, and the same bits on every rank that holds the same payloads in the same order.
    Payloads of several tensors (:meth:`~hexagram.compress.base.Compressor.compress_segments`)
    go to the compressor's :meth:`~hexagram.compress.base.Compressor.decompress_segments_sum`.

    Example:
        >>> import torch, hexagram.compress as hc
        >>> c = hc.get("fp16")
        >>> decode_sum(c, [c.compress(torch.ones(2))] * 3, torch.empty(2)).tolist()
        [3.0, 3.0]
    """
    if payloads and "segments" in payloads[0].meta:  # several tensors per payload
        return compressor.decompress_segments_sum(payloads, out, finish)
    if sum_payloads(compressor, list(payloads), out, finish or _keep) is not None:
        return out
    for i, p in enumerate(payloads):
        compressor.decompress_into(p, out, add=i > 0)
    return out if finish is None else finish(out)


def _keep(t: Tensor) -> Tensor:
    return t


def sum_payloads(compressor: Compressor, payloads: list[Payload], out: Tensor,
                 finish: Callable[[Tensor], Tensor]) -> Tensor | None:
    """``out`` (1-D) := ``finish(sum of the decoded payloads, in rank order)``, or None
    (nothing written) when the format or the number of ranks does not allow it.

    ``finish`` acts in place on a tensor of sums (e.g. ``div_`` by P for the mean,
    ``sign_`` for a majority vote), exactly as it would on the summed output.
    """
    tables = [t for t in (compressor.code_table(p) for p in payloads) if t is not None]
    if not tables or len(tables) != len(payloads) or out.numel() == 0:
        return None
    bits = tables[0][0]
    if bits not in (1, 2, 4) or bits * len(payloads) > 8:
        return None
    sums = _sums([t[1] for t in tables], bits, finish, out.dtype)
    return _decode_combined([t[2] for t in tables], bits, sums, out)


def _sums(values: list[Tensor], bits: int, finish: Callable[[Tensor], Tensor],
          dtype: torch.dtype) -> Tensor:
    """(2**(bits P),) ``finish(values_0[c_0] + ... )`` for every index ``sum c_r << bits r``."""
    combos = torch.arange(1 << (bits * len(values)), device=values[0].device)
    total = values[0].to(dtype)[combos & ((1 << bits) - 1)]
    for r, v in enumerate(values[1:], 1):
        total.add_(v.to(dtype)[(combos >> (bits * r)) & ((1 << bits) - 1)])
    return finish(total)


def _spread(bits: int, width: int, rank: int, device: torch.device) -> Tensor:
    """(256,) words: the codes of a packed byte, code i moved to bit ``width i + bits rank``."""
    codes = byte_codes(bits, device).to(dtype=torch.int64)  # (256, 8 // bits)
    shifts = width * torch.arange(8 // bits, device=device) + bits * rank
    words = (codes << shifts).sum(1)
    dtype = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}
    return words.to(dtype[width * 8 // bits])


def _decode_combined(packed: list[Tensor], bits: int, sums: Tensor, out: Tensor) -> Tensor:
    """Index each element by its ranks' codes (4-bit fields when they fit, else bytes) and
    look the sums up: pairs of elements per byte through a (256, 2) table for 4-bit fields."""
    width = 4 if bits * len(packed) <= 4 else 8
    spreads = [_spread(bits, width, r, out.device) for r in range(len(packed))]
    per_byte = 8 // width  # elements per index byte
    # table indexed by an index byte: the sums of its per_byte elements, low field first
    b = torch.arange(256, device=out.device)
    field = sums.new_zeros(1 << width)  # every field value; unused ones (never indexed) 0
    field[: sums.numel()] = sums
    table = torch.stack([field[(b >> (width * i)) & ((1 << width) - 1)]
                         for i in range(per_byte)], 1).contiguous()
    # a row of two sums as one element (index_select of single elements is faster)
    wide = None if per_byte == 1 else {2: torch.int16, 4: torch.int32, 8: torch.int64,
                                       16: torch.complex128}[2 * out.element_size()]
    n, block = out.numel(), block_size(out.device)
    tmp = out.new_empty(min(block, n) + 8)
    for start, stop in blocks(n, block):
        first, nbytes = start * bits // 8, packed_nbytes(stop - start, bits)
        words = torch.index_select(spreads[0], 0, packed[0][first:first + nbytes].int())
        for spread, p in zip(spreads[1:], packed[1:]):
            words |= torch.index_select(spread, 0, p[first:first + nbytes].int())
        idx = words.view(torch.uint8).int()  # one index byte per per_byte elements
        dst = tmp[: idx.numel() * per_byte]
        if wide is None:
            torch.index_select(table.view(-1), 0, idx, out=dst)
        else:
            torch.index_select(table.view(wide).view(-1), 0, idx, out=dst.view(wide))
        out[start:stop].copy_(dst[: stop - start])
    return out
