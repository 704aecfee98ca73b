"""Block-wise scales for the ``efsign`` and ``onebit`` compressors (``block=B`` > 0).

With one scale per tensor, a sign compressor moves every element of a layer by the same
amount: small elements overshoot, large ones are sent a little at a time and wait in the
error-feedback residual for many steps. That wait is staleness, and with the user's
heavy-ball momentum it destabilises training, as one-step delay does
(docs/benchmarks/delay.md): on Fashion-MNIST (an MLP 784-128-10, 4 ranks, batch 128, SGD lr
0.05, momentum 0.9, 5 epochs; allreduce 85.3 %) per-tensor 1-bit SGD reached 44.9 % and
EF-sign 41.3 % in a single-process replay. One scale (``efsign``: mean |x|) or pair of
reconstruction values (``onebit``: the mean of each sign half) per block of ``B``
consecutive elements keeps the magnitudes of the block's elements close to its scale: with
``B = 512`` 1-bit SGD reached 83.3 % in the replay (1024: 79.8 %, 4096: 61.3 %); in the real
4-rank harness (benchmarks/delay_convergence.py, allreduce 85.5 %) 1-bit SGD / EF-sign
reached 47.3 / 49.6 % per tensor, 83.1 / 81.3 % with ``B = 512`` and 85.0 / 83.5 % with
``B = 256``, the ``onebit`` and ``efsign`` algorithms' default.

Wire format (``n`` elements, ``G = ceil(n / B)`` blocks, ``h`` the header dtype: float32,
float64 for float64 input): ``efsign`` (G,) h [mean |x| of each block]; ``onebit`` (G, 2) h
[mean of the negative entries, mean of the non-negative ones, per block]; then the
``ceil(n / 8)`` bytes of sign bits (1 where ``x >= 0``), as without blocks. Header cost:
``4 G`` resp. ``8 G`` bytes, i.e. 0.125 resp. 0.25 bits per element at ``B = 256``.

Example:
    >>> import torch
    >>> x = torch.tensor([1.0, 3.0, -2.0, 0.0, -1.0, 5.0])
    >>> header, bits = encode_blocked(x, 4, "onebit", "onebit")
    >>> header.tolist()
    [[-2.0, 1.3333333730697632], [-1.0, 5.0]]
    >>> decode_blocked(header, bits, 6, 4, "onebit", torch.float32).tolist()
    [1.3333333730697632, 1.3333333730697632, -2.0, 1.3333333730697632, -1.0, 5.0]
"""

from __future__ import annotations

import torch
from torch import Tensor

from hexagram.compress.chunks import decode_affine, halves, work_dtype
from hexagram.compress.packing import cpu_fast
from hexagram.compress.sign_bits import encode_signs  # the same bits as without blocks

__all__ = ["blocked_rows", "check_header", "decode_blocked", "encode_blocked", "header_shape",
           "row_header"]


def header_shape(kind: str, n: int, block: int) -> tuple[int, ...]:
    """The header's shape for ``n`` elements in blocks of ``block`` (``kind``: efsign or
    onebit)."""
    groups = -(-n // block)
    return (groups,) if kind == "efsign" else (groups, 2)


def row_header(rows: Tensor, sizes: Tensor | int, kind: str, dtype: torch.dtype) -> Tensor:
    """The header values of the blocks in the rows of ``rows`` ((R, B), padded with zeros
    beyond ``sizes`` real elements per row), float64, in the work dtype of ``dtype``:
    efsign (R,) mean |x|; onebit (R, 2) [mean of x < 0, mean of x >= 0] (0 for an empty
    half). A row's values do not depend on the rows beside it."""
    abs_sum = rows.abs().sum(1, dtype=torch.float64)
    count = torch.as_tensor(sizes, dtype=torch.float64, device=rows.device)
    if kind == "efsign":
        return (abs_sum / count).to(work_dtype(dtype))
    total = rows.sum(1, dtype=torch.float64)
    # zero padding counts as x >= 0: take it off
    pos = (rows >= 0).sum(1).to(torch.float64) - (rows.shape[1] - count)
    neg = count - pos
    # sum over x >= 0 is (sum x + sum |x|) / 2, over x < 0 (sum x - sum |x|) / 2
    values = torch.stack([((total - abs_sum) / 2 / neg.clamp(min=1)),
                          ((total + abs_sum) / 2 / pos.clamp(min=1))], dim=1)
    return values.to(work_dtype(dtype))


def _blocks_header(flat: Tensor, block: int, kind: str) -> Tensor:
    """:func:`row_header` of the blocks of one tensor: the whole blocks as a view, the
    short last one copied into a zero-padded row (as a bucket's padded rows hold it)."""
    n = flat.numel()
    full = n - n % block
    parts = [row_header(flat[:full].view(-1, block), block, kind, flat.dtype)] if full else []
    if full < n:
        tail = flat.new_zeros(1, block)
        tail[0, : n - full] = flat[full:]
        parts.append(row_header(tail, n - full, kind, flat.dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def check_header(header: Tensor, who: str) -> None:
    """ValueError where a block's reconstruction value overflowed the header's dtype."""
    if not bool(torch.isfinite(header).all()):
        raise ValueError(f"{who}: a block's reconstruction value overflows {header.dtype}; "
                         "scale the tensor down first")


def encode_blocked(flat: Tensor, block: int, kind: str, who: str, check: bool = True
                   ) -> tuple[Tensor, Tensor]:
    """The header (see the module doc) and the packed sign bits of the 1-D ``flat``.

    With ``check``, raises :class:`~hexagram.compress.base.NonFiniteGradientError` on
    NaN/Inf (through the shared sign encoder) and ValueError when a header value overflows
    its dtype; without, reads nothing: NaN/Inf reach the header (their block decodes to
    NaN/Inf) and an overflowing header value is Inf.
    """
    bits, _ = encode_signs(flat, who, stats=False, check=check)
    header = _blocks_header(flat, block, kind)
    if check:
        check_header(header, who)
    return header, bits


def blocked_rows(header: Tensor, kind: str, device_path: bool) -> Tensor:
    """(G, 2 or 3) per block ``[scale, offset(, post)]``: a sign bit decodes to
    ``(bit * scale + offset) (* post)`` in the rows' dtype (:func:`decode_blocked`'s
    arithmetic, for a bucket's decoder)."""
    if kind == "efsign" and device_path:  # -s + bit * 2 s; halves where 2 s overflows
        factor, post = halves(~torch.isfinite(header * 2), header.dtype)
        h = header * factor
        return torch.stack([h * 2, -h, post], 1)
    if kind == "efsign":  # -s + bit * 2 s: +-s exactly, in float64 where 2 s overflows
        h = header.double() if not bool(torch.isfinite(header * 2).all()) else header
        return torch.stack([h * 2, -h], 1)
    h = header.double()  # neg + bit * (pos - neg), in float64: exactly pos for bit 1
    return torch.stack([h[:, 1] - h[:, 0], h[:, 0]], 1)


def decode_blocked(header: Tensor, bits: Tensor, n: int, block: int, kind: str,
                   dtype: torch.dtype, out: Tensor | None = None, add: bool = False) -> Tensor:
    """Dense values of a blocked payload: bit 1 -> the block's positive value, bit 0 -> its
    negative one (``efsign``: +- scale); into (or added to, ``add``) ``out`` if given."""
    rows = blocked_rows(header, kind, not cpu_fast(bits))
    post = rows[:, 2].contiguous() if rows.shape[1] > 2 else None
    return decode_affine(bits, 1, n, block, rows[:, 0].contiguous(),
                         rows[:, 1].contiguous(), dtype, out, add, post=post)
