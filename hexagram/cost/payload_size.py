"""Payload layouts from shapes alone: what each compressor would put on the wire, without
compressing anything.

:func:`hexagram.cost.schedule.payload_of` learns a payload's size by compressing a random
tensor of the shape (which also times the compressor: ``auto`` wants that). The simulator
only needs sizes, for thousands of shapes and configurations, so it reads them from each
compressor's own declaration instead (:meth:`hexagram.compress.base.Compressor.wire_layout`,
the shape and dtype of every tensor ``compress`` returns, derived from its config and the
input's shape and dtype, as each compressor module documents its wire format).

A compressor that does not declare its layout (a user's own) gets ``None``, and so does a
subclass that overrides ``compress`` without declaring the layout again (it may have
changed the format): the caller then sizes it by compressing, as before.
``tests/test_cost_payload_size.py`` checks every registered compressor's declaration against
its real payload at several shapes and configurations, so the two cannot drift.

Example:
    >>> import hexagram.compress as hc
    >>> payload_nbytes(hc.get("qsgd", levels=7, bucket_size=512), (1000, 3))  # 4 bits
    1524
    >>> [(s, str(d)) for s, d in payload_layout(hc.get("topk", density=0.01), (1000,))]
    [((10,), 'torch.float32'), ((10,), 'torch.int32')]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hexagram.compress.base import Compressor, Layout, Payload

__all__ = ["Layout", "declares_layout", "meta_payload", "payload_layout", "payload_nbytes"]


def _definer(cls: type, attr: str) -> type:
    """The class in ``cls``'s MRO whose body defines ``attr``."""
    return next(c for c in cls.__mro__ if attr in vars(c))


def declares_layout(compressor: Compressor) -> bool:
    """True if ``compressor``'s class declares its wire layout for the ``compress`` it runs:
    the class defining ``wire_layout`` is the one defining ``compress`` or below it.

    >>> import hexagram.compress as hc
    >>> declares_layout(hc.get("topk"))
    True
    """
    cls = type(compressor)
    layout = _definer(cls, "wire_layout")
    return layout is not Compressor and issubclass(layout, _definer(cls, "compress"))


def payload_layout(compressor: Compressor, shape: Sequence[int],
                   dtype: torch.dtype = torch.float32) -> Layout | None:
    """Shape and dtype of each tensor ``compressor.compress(x)`` returns for ``x`` of
    ``shape`` and ``dtype``; ``None`` if the compressor's class has no rule here.

    Raises:
        ValueError: an empty shape (``numel == 0``, which no compressor accepts), or
            more kept elements (``k``) than the tensor has.
        TypeError: a dtype that is not floating point.
    """
    if not declares_layout(compressor):
        return None
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if n == 0:
        raise ValueError(f"{compressor.name}: cannot size the payload of an empty tensor "
                         f"(shape {shape}); compressors take at least one element")
    if not dtype.is_floating_point:
        raise TypeError(f"{compressor.name}: payloads are defined for floating-point tensors, "
                        f"got {dtype}; pass the gradients' dtype (e.g. torch.float32)")
    return compressor.wire_layout(shape, dtype)


def payload_nbytes(compressor: Compressor, shape: Sequence[int],
                   dtype: torch.dtype = torch.float32) -> int | None:
    """Wire bytes of the payload (``Payload.nbytes``) of a tensor of ``shape`` and
    ``dtype``, or ``None`` where :func:`payload_layout` has none."""
    layout = payload_layout(compressor, shape, dtype)
    if layout is None:
        return None
    return sum(math.prod(s) * d.itemsize for s, d in layout)


def meta_payload(compressor: Compressor, shape: Sequence[int],
                 dtype: torch.dtype = torch.float32) -> Payload | None:
    """A :class:`Payload` of :func:`payload_layout` whose tensors live on the ``meta``
    device (shapes and dtypes, no data: ``nbytes``, ``numel()`` and ``element_size()``
    work, values do not), or ``None`` without a declared layout. A 0-d shape is sized as one
    element, as :func:`hexagram.cost.schedule.payload_of` compresses it."""
    sized = tuple(shape) if len(shape) else (1,)
    layout = payload_layout(compressor, sized, dtype)
    if layout is None:
        return None
    tensors = tuple(torch.empty(s, dtype=d, device="meta") for s, d in layout)
    return Payload(tensors, torch.Size(shape), dtype)
