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

__all__ = ["decode_blocked", "encode_blocked", "header_shape"]


def header_shape(kind: str, n: int, block: int) -> tuple[int, ...]:
    """The header's shape for ``n`` elements in blocks of ``block`` (``kind``: efsign or
    onebit)."""
    groups = -(-n // block)
    return (groups,) if kind == "efsign" else (groups, 2)


def _block_sums(flat: Tensor, block: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per block: sum |x|, sum x, count(x >= 0), element count (float64 sums of blocks
    summed in the input's dtype)."""
    n = flat.numel()
    full = n - n % block
    parts = [flat[:full].view(-1, block)] if full else []
    if full < n:
        parts.append(flat[full:].view(1, -1))
    abs_sum, total, pos, count = [], [], [], []
    for rows in parts:
        abs_sum.append(rows.abs().sum(1, dtype=torch.float64))
        total.append(rows.sum(1, dtype=torch.float64))
        pos.append((rows >= 0).sum(1).to(torch.float64))
        count.append(torch.full((rows.shape[0],), float(rows.shape[1]), dtype=torch.float64,
                                device=flat.device))
    return tuple(torch.cat(t) for t in (abs_sum, total, pos, count))  # type: ignore[return-value]


def encode_blocked(flat: Tensor, block: int, kind: str, who: str, check: bool = True
                   ) -> tuple[Tensor, Tensor]:
    """The header (see the module doc) and the packed sign bits of the 1-D ``flat``.

    With ``check``, raises :class:`~hexagram.compress.base.NonFiniteGradientError` on
    NaN/Inf (through the shared sign encoder) and ValueError when a header value overflows
    its dtype; without, reads nothing: NaN/Inf reach the header (their block decodes to
    NaN/Inf) and an overflowing header value is Inf.
    """
    bits, _ = encode_signs(flat, who, stats=False, check=check)
    abs_sum, total, pos, count = _block_sums(flat, block)
    if kind == "efsign":
        values = abs_sum / count
    else:  # sum over x >= 0 is (sum x + sum |x|) / 2, over x < 0 (sum x - sum |x|) / 2
        neg = count - pos
        values = torch.stack([((total - abs_sum) / 2 / neg.clamp(min=1)),
                              ((total + abs_sum) / 2 / pos.clamp(min=1))], dim=1)
    header = values.to(work_dtype(flat.dtype))
    if check and not bool(torch.isfinite(header).all()):
        raise ValueError(f"{who}: a block's reconstruction value overflows {header.dtype}; "
                         "scale the tensor down first")
    return header, bits


def decode_blocked(header: Tensor, bits: Tensor, n: int, block: int, kind: str,
                   dtype: torch.dtype, out: Tensor | None = None, add: bool = False) -> Tensor:
    """Dense values of a blocked payload: bit 1 -> the block's positive value, bit 0 -> its
    negative one (``efsign``: +- scale); into (or added to, ``add``) ``out`` if given."""
    if kind == "efsign" and not cpu_fast(bits):  # -s + bit * 2 s; halves where 2 s overflows
        factor, post = halves(~torch.isfinite(header * 2), header.dtype)
        h = header * factor
        return decode_affine(bits, 1, n, block, h * 2, -h, dtype, out, add, post=post)
    h = header.double() if kind == "efsign" and not bool(torch.isfinite(header * 2).all()) \
        else header
    if kind == "efsign":  # -s + bit * 2 s
        scale, offset = h * 2, -h
    else:  # neg + bit * (pos - neg), in float64: exactly pos for bit 1 (float32 headers)
        h = h.double()
        scale, offset = h[:, 1] - h[:, 0], h[:, 0].clone()
    return decode_affine(bits, 1, n, block, scale.contiguous(), offset.contiguous(), dtype,
                         out, add)
