"""Payload layouts from shapes alone: what each compressor would put on the wire, without
compressing anything.

:func:`hexagram.cost.schedule.payload_of` learns a payload's size by compressing a random
tensor of the shape (which also times the compressor: ``auto`` wants that). The simulator
only needs sizes, for thousands of shapes and configurations, so it reads them from this
module's formulas instead (:func:`payload_layout`): the shape and dtype of every tensor
``compress`` returns, derived from the compressor's config and the input's shape and dtype,
as each compressor module documents its wire format (``n`` elements; ``h`` the header
dtype: float32, float64 for float64 input):

| compressor | payload tensors |
|---|---|
| fp16, bf16 | the input's shape in the wire dtype |
| minmax8, minmax4 | (G, 2) h, G = ceil(n / chunk_size); (ceil(n b / 8),) uint8, b = 8, 4 |
| qsgd | (G,) h, G = ceil(n / bucket_size); (ceil(n b / 8),) uint8, b = bit_length(2 levels) |
| terngrad | (1,) h; (ceil(n / 4),) uint8 |
| sign | ((1,) h if scaled); (ceil(n / 8),) uint8 |
| efsign, onebit | (G,) resp. (G, 2) h, G = ceil(n / block) (0: (1,), (2,)); (ceil(n / 8),) u8 |
| topk, randomk | (k,) input dtype; (k,) int32 (int64 from 2**31 elements), k = config.count(n) |
| threshold | (1,) int32; (c,) input dtype; (c,) index dtype, c = capacity(n) |
| powersgd | (rows, r) h; (cols, r) h: the matrix view of the input, r = min(rank, rows, cols) |
| chunktopk, dcttopk (SparseLoCo's, DeMo's) | their own ``layout(n, dtype)`` |

A compressor class without a rule here (a user's own, or a subclass that may change the
format) gets ``None``: the caller then sizes it by compressing, as before.
``tests/test_cost_payload_size.py`` checks every rule against the real payload of every
registered compressor at several shapes and configurations, so the two cannot drift.

Example:
    >>> import hexagram.compress as hc
    >>> payload_nbytes(hc.get("qsgd", levels=7, bucket_size=512), (1000, 3))  # 4 bits
    1524
    >>> [(s, str(d)) for s, d in payload_layout(hc.get("topk", density=0.01), (1000,))]
    [((10,), 'torch.float32'), ((10,), 'torch.int32')]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from hexagram.compress.base import Compressor, Payload
from hexagram.compress.chunk_topk import ChunkTopKCompressor
from hexagram.compress.dct import DCTTopKCompressor
from hexagram.compress.lowrank import PowerSGDCompressor, matrix_shape
from hexagram.compress.packing import packed_nbytes
from hexagram.compress.quantize import (
    MinMax4Compressor,
    MinMax8Compressor,
    QSGDCompressor,
    TernGradCompressor,
)
from hexagram.compress.quantize_fp import BF16Compressor, HalfCompressor
from hexagram.compress.sign_blocks import header_shape
from hexagram.compress.signs import EFSignCompressor, OneBitCompressor, SignCompressor
from hexagram.compress.sparsify import RandomKCompressor, ThresholdCompressor, TopKCompressor

__all__ = ["RULES", "Layout", "meta_payload", "payload_layout", "payload_nbytes"]

#: shape and dtype of each tensor of a payload, in the payload's order
Layout = tuple[tuple[tuple[int, ...], torch.dtype], ...]
Rule = Callable[[Compressor, tuple[int, ...], int, torch.dtype], Layout]

_U8 = torch.uint8


def _header(dtype: torch.dtype) -> torch.dtype:
    """Header dtype of the chunked and sign formats (``chunks.work_dtype``)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _index(n: int) -> torch.dtype:
    """Index dtype of the sparsifiers: int32 below 2**31 elements."""
    return torch.int32 if n < 2**31 else torch.int64


def _cast(c: Compressor, shape: tuple[int, ...], n: int, dtype: torch.dtype) -> Layout:
    return ((shape, c.wire_dtype),)  # type: ignore[attr-defined]


def _minmax(c: Compressor, shape: tuple[int, ...], n: int, dtype: torch.dtype) -> Layout:
    chunks = -(-n // c.config.chunk_size)
    bits = c.bits  # type: ignore[attr-defined]
    return (((chunks, 2), _header(dtype)), ((packed_nbytes(n, bits),), _U8))


def _qsgd(c: Compressor, shape: tuple[int, ...], n: int, dtype: torch.dtype) -> Layout:
    chunks = -(-n // c.config.bucket_size)
    bits = (2 * c.config.levels).bit_length()
    return (((chunks,), _header(dtype)), ((packed_nbytes(n, bits),), _U8))


def _terngrad(c: Compressor, shape: tuple[int, ...], n: int, dtype: torch.dtype) -> Layout:
    return (((1,), _header(dtype)), ((packed_nbytes(n, 2),), _U8))


def _signs(header: int) -> Rule:
    """A 1-bit format with ``header`` header values (sign: 1 if ``scaled`` else 0)."""
    def rule(c: Compressor, shape: tuple[int, ...], n: int, dtype: torch.dtype) -> Layout:
        count = header if header >= 0 else int(c.config.scaled)
        head: Layout = (((count,), _header(dtype)),) if count else ()
        block = getattr(c.config, "block", 0)
        if block:  # efsign / onebit with block-wise scales
            head = ((header_shape(c.name, n, block), _header(dtype)),)
        return (*head, ((packed_nbytes(n, 1),), _U8))
    return rule


def _pairs(c: Compressor, shape: tuple[int, ...], n: int, dtype: torch.dtype) -> Layout:
    k = c.config.count(n)  # raises for k > n, as compress does
    return (((k,), dtype), ((k,), _index(n)))


def _threshold(c: Compressor, shape: tuple[int, ...], n: int, dtype: torch.dtype) -> Layout:
    cap = c.capacity(n)  # type: ignore[attr-defined]
    return (((1,), torch.int32), ((cap,), dtype), ((cap,), _index(n)))


def _powersgd(c: Compressor, shape: tuple[int, ...], n: int, dtype: torch.dtype) -> Layout:
    rows, cols = matrix_shape(torch.Size(shape))
    r = min(c.config.rank, rows, cols)
    return (((rows, r), _header(dtype)), ((cols, r), _header(dtype)))


def _own(c: Compressor, shape: tuple[int, ...], n: int, dtype: torch.dtype) -> Layout:
    """Compressors that state their own layout (``layout(n, dtype)``)."""
    return c.layout(n, dtype)  # type: ignore[attr-defined, no-any-return]


#: the rule of each compressor class (exact type: a subclass may change the format)
RULES: dict[type[Compressor], Rule] = {
    HalfCompressor: _cast, BF16Compressor: _cast, MinMax8Compressor: _minmax,
    MinMax4Compressor: _minmax,
    QSGDCompressor: _qsgd, TernGradCompressor: _terngrad, SignCompressor: _signs(-1),
    EFSignCompressor: _signs(1), OneBitCompressor: _signs(2), TopKCompressor: _pairs,
    RandomKCompressor: _pairs, ThresholdCompressor: _threshold, PowerSGDCompressor: _powersgd,
    ChunkTopKCompressor: _own, DCTTopKCompressor: _own,
}


def payload_layout(compressor: Compressor, shape: Sequence[int],
                   dtype: torch.dtype = torch.float32) -> Layout | None:
    """Shape and dtype of each tensor ``compressor.compress(x)`` returns for ``x`` of
    ``shape`` and ``dtype``; ``None`` if the compressor's class has no rule here.

    Raises:
        ValueError: an empty shape (``numel == 0``, which no compressor accepts), or
            more kept elements (``k``) than the tensor has.
        TypeError: a dtype that is not floating point.
    """
    rule = RULES.get(type(compressor))
    if rule is None:
        return None
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if n == 0:
        raise ValueError(f"{compressor.name}: cannot size the payload of an empty tensor "
                         f"(shape {shape}); compressors take at least one element")
    if not dtype.is_floating_point:
        raise TypeError(f"{compressor.name}: payloads are defined for floating-point tensors, "
                        f"got {dtype}; pass the gradients' dtype (e.g. torch.float32)")
    return rule(compressor, shape, n, dtype)


def payload_nbytes(compressor: Compressor, shape: Sequence[int],
                   dtype: torch.dtype = torch.float32) -> int | None:
    """Wire bytes of the payload (``Payload.nbytes``) of a tensor of ``shape`` and
    ``dtype``, or ``None`` where :func:`payload_layout` has no rule."""
    layout = payload_layout(compressor, shape, dtype)
    if layout is None:
        return None
    return sum(math.prod(s) * d.itemsize for s, d in layout)


def meta_payload(compressor: Compressor, shape: Sequence[int],
                 dtype: torch.dtype = torch.float32) -> Payload | None:
    """A :class:`Payload` of :func:`payload_layout` whose tensors live on the ``meta``
    device (shapes and dtypes, no data: ``nbytes``, ``numel()`` and ``element_size()``
    work, values do not), or ``None`` without a rule. A 0-d shape is sized as one
    element, as :func:`hexagram.cost.schedule.payload_of` compresses it."""
    sized = tuple(shape) if len(shape) else (1,)
    layout = payload_layout(compressor, sized, dtype)
    if layout is None:
        return None
    tensors = tuple(torch.empty(s, dtype=d, device="meta") for s, d in layout)
    return Payload(tensors, torch.Size(shape), dtype)
