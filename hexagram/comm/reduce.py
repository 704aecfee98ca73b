"""Reduce tensors over ranks, with or without a compressor: the one path every algorithm uses.

:func:`reduce_many` (and :func:`reduce` for one tensor) picks the collective from the
compressor's :attr:`~hexagram.compress.base.Compressor.aggregation` with one rule
(:func:`route`), encodes, communicates, decodes straight into the output buffers and counts
the bytes through the communicator. Gradients and weights, exact and compressed, go through it.

The rule (:func:`route`):

=====================================================  =======================================
compressor                                              collective
=====================================================  =======================================
``None``                                                allreduce in full precision
``SUM`` whose payloads sum tensor by tensor (fp16)      allreduce of the payload tensors
``SCATTER_GATHER`` (8-bit min-max, QSGD), when the      scatter-gather: compress, all-to-all,
caller needs no exact local payload and the             decode + reduce, recompress, allgather
reduction is not a vote
anything else (``GATHER``, PowerSGD factors, a          allgather of payloads, then the
``SCATTER_GATHER`` format under error feedback)         decode-and-sum of every rank's payload
=====================================================  =======================================

A caller that must know exactly what it sent (error feedback: ``residual = corrected -
decode(payload)``) passes ``encode``; then the route never re-compresses (scatter-gather's
second leg would send a payload nobody's residual accounts for), so ``SCATTER_GATHER`` formats
are allgathered. ``encode(i, tensor, divisor)`` returns the payload of ``tensor / divisor``:
the ``SUM`` route divides by the world size *before* encoding for a mean (a 16-bit sum cannot
overflow), so an error-feedback encoder counts ``divisor * decode(payload)`` as sent.

Received payloads are checked on the device (:mod:`hexagram.comm.faults`): a caller that
passes ``faults`` (a sink, e.g. ``ctx.checks.add``) receives, per reduced tensor, a 0-d
bool flag of malformed payloads with an explanation naming the sending rank (gathered
payloads; scatter-gather's poisoned chunks) or saying that a sum hides it.

Multi-stage work is chained on the returned :class:`~hexagram.comm.communicator.Handle`
(``handle.then(next_stage)``), as PyTorch's comm hooks chain ``Future.then``.

Example:
    >>> h = reduce(comm, grad, hexagram.compress.get("minmax8"))   # doctest: +SKIP
    >>> mean = h.wait()                                             # doctest: +SKIP
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.faults import FaultSink, check_gathered, check_summed
from hexagram.compress.base import Aggregation, Compressor, Payload
from hexagram.compress.combine import decode_sum
from hexagram.compress.segments import Segments

__all__ = ["REDUCTIONS", "Encoder", "Reduction", "Route", "reduce", "reduce_many", "route"]

Reduction = Literal["mean", "sum", "majority"]
#: ``mean`` (the data-parallel average), ``sum``, ``majority`` (sign of the sum: signSGD's vote)
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "majority")

#: ``encode(index, tensor, divisor) -> payload of tensor / divisor`` (see the module doc)
Encoder = Callable[[int, Tensor, int], Payload]


class Route(enum.Enum):
    """Which collective carries a reduction (see :func:`route`)."""

    ALLREDUCE = "allreduce"
    SUM = "sum"
    SCATTER_GATHER = "scatter_gather"
    GATHER = "gather"


def route(compressor: Compressor | None, *, exact_local: bool = False,
          reduction: str = "mean") -> Route:
    """The collective for ``compressor`` (the one rule of the module doc).

    ``exact_local``: the caller needs the payload it sent to be the one every rank decodes
    (error feedback), which rules out scatter-gather's re-compression.

    >>> import hexagram.compress as hc
    >>> route(None).value, route(hc.get("fp16")).value, route(hc.get("minmax8")).value
    ('allreduce', 'sum', 'scatter_gather')
    >>> route(hc.get("minmax8"), exact_local=True).value, route(hc.get("topk")).value
    ('gather', 'gather')
    """
    if compressor is None:
        return Route.ALLREDUCE
    if compressor.aggregation is Aggregation.SUM and compressor.payload_sums_elementwise:
        return Route.SUM
    if compressor.aggregation is Aggregation.SCATTER_GATHER and not exact_local \
            and reduction != "majority":
        return Route.SCATTER_GATHER
    return Route.GATHER


def reduce(comm: Communicator, tensor: Tensor, compressor: Compressor | None = None, *,
           reduction: str = "mean", out: Tensor | None = None, encode: Encoder | None = None,
           generator: torch.Generator | None = None,
           reduce_generator: torch.Generator | None = None,
           faults: FaultSink | None = None) -> Handle[Tensor]:
    """:func:`reduce_many` of one tensor; the handle's result is the reduced tensor."""
    return reduce_many(comm, [tensor], compressor, reduction=reduction,
                       outs=None if out is None else [out], encode=encode,
                       generator=generator, reduce_generator=reduce_generator,
                       faults=faults).then(lambda results: results[0])


def reduce_many(comm: Communicator, tensors: Sequence[Tensor],
                compressor: Compressor | None = None, *, reduction: str = "mean",
                outs: Sequence[Tensor] | None = None, encode: Encoder | None = None,
                generator: torch.Generator | None = None,
                reduce_generator: torch.Generator | None = None,
                segments: Sequence[Segments | None] | None = None,
                faults: FaultSink | None = None) -> Handle[list[Tensor]]:
    """Reduce each of ``tensors`` over the ranks of ``comm``; one message per leg for all.

    Args:
        tensors: contiguous tensors, the same shapes on every rank; each is compressed on its
            own (layer-wise scales, norms and top-k).
        compressor: ``None`` for full precision; otherwise its aggregation picks the route.
        reduction: ``"mean"``, ``"sum"`` or ``"majority"`` (element-wise sign of the sum).
        outs: where the results go (same shapes and dtypes; may be ``tensors`` themselves:
            every input is encoded before this returns, and may then be overwritten);
            default: new tensors, inputs untouched.
        encode: the caller's encoder (error feedback); see the module doc.
        generator, reduce_generator: draws of the first and (scatter-gather) second
            compression, for stochastic compressors.
        segments: per tensor, ``None`` (compressed as one tensor) or the
            :class:`~hexagram.compress.segments.Segments` of the several tensors it lays
            end to end (1-D), each compressed on its own in one call
            (:meth:`~hexagram.compress.base.Compressor.compress_segments`; an ``encode``
            must do the same) and decoded in one call: a bucket's layer-wise compression
            in a handful of kernels. The scatter-gather route compresses them
            segment by segment (its chunks are per tensor).
        faults: where the flags of malformed received payloads go (see the module doc);
            ``None``: not checked (the decoders stay safe on any bytes).

    Returns:
        A handle whose result is the list of outputs, every rank's bit for bit the same.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")
    results = list(outs) if outs is not None else [torch.empty_like(t) for t in tensors]
    if len(results) != len(tensors):
        raise ValueError(f"outs has {len(results)} tensors for {len(tensors)} inputs")
    segs = list(segments) if segments is not None else [None] * len(tensors)
    if len(segs) != len(tensors):
        raise ValueError(f"segments has {len(segs)} entries for {len(tensors)} inputs")
    if reduction == "majority" and any(s is not None for s in segs):
        raise ValueError("a majority vote is scaled per tensor: pass segmented tensors one "
                         "view per segment (segments=None) to reduce them by majority")
    way = route(compressor, exact_local=encode is not None, reduction=reduction)
    if way is Route.ALLREDUCE or compressor is None:
        return _allreduce(comm, tensors, results, reduction)
    if way is Route.SCATTER_GATHER:
        return _scatter_gather(comm, tensors, compressor, reduction, generator,
                               reduce_generator, results, segs, faults)
    comp = compressor
    owned = [r.data_ptr() == t.data_ptr() for t, r in zip(tensors, results)]

    def default_encode(i: int, t: Tensor, divisor: int) -> Payload:
        if divisor > 1:  # the caller's buffer is ours to scale; else a scaled copy
            t = t.div_(divisor) if owned[i] else t / divisor
        seg = segs[i]
        return comp.compress(t, generator) if seg is None \
            else comp.compress_segments(t, seg, generator)

    enc = encode or default_encode
    if way is Route.SUM:
        divisor = comm.size if reduction == "mean" else 1
        payloads = [enc(i, t, divisor) for i, t in enumerate(tensors)]
        vote = "majority" if reduction == "majority" else "sum"

        def decode_sums(summed: list[Payload]) -> list[Tensor]:
            for i, p in enumerate(summed):
                check_summed(faults, comp, p, f"tensor {i} of the message")
            return _decode(comp, [[p] for p in summed], results, vote, comm.size)

        return primitives.allreduce_payloads(comm, payloads).then(decode_sums)
    payloads = [enc(i, t, 1) for i, t in enumerate(tensors)]

    def decode_gathered(per_tensor: list[list[Payload]]) -> list[Tensor]:
        for i, ps in enumerate(per_tensor):
            check_gathered(faults, comp, ps, f"tensor {i} of the message")
        return _decode(comp, per_tensor, results, reduction, comm.size)

    return primitives.allgather_payloads_many(comm, payloads).then(decode_gathered)


def _scatter_gather(comm: Communicator, tensors: Sequence[Tensor], comp: Compressor,
                    reduction: str, generator: torch.Generator | None,
                    reduce_generator: torch.Generator | None, results: list[Tensor],
                    segs: Sequence[Segments | None],
                    faults: FaultSink | None) -> Handle[list[Tensor]]:
    """Scatter-gather; segmented tensors go segment by segment (each tensor is cut in P
    chunks of its own), or in one call where one rank is all (compress, then decode)."""
    if comm.size == 1:
        for t, res, seg in zip(tensors, results, segs):
            if seg is None:
                comp.decompress_into(comp.compress(t, generator), res.view(-1))
            else:
                comp.decompress_segments_into(comp.compress_segments(t, seg, generator),
                                              res.view(-1))
        return Handle.completed(results, "scatter_gather")
    if all(s is None for s in segs):
        return primitives.scatter_gather_many(comm, tensors, comp, reduction == "mean",
                                              generator, reduce_generator, results, faults)
    ins: list[Tensor] = []
    outs: list[Tensor] = []
    for t, res, seg in zip(tensors, results, segs):
        ins += [t] if seg is None else seg.views(t)
        outs += [res] if seg is None else seg.views(res.view(-1))
    return primitives.scatter_gather_many(comm, ins, comp, reduction == "mean", generator,
                                          reduce_generator, outs, faults
                                          ).then(lambda _: results)


def _finish(reduction: str, size: int, scale: Tensor | None = None
            ) -> Callable[[Tensor], Tensor] | None:
    """What turns a sum over ranks into the reduction, in place (``scale``: the vote's)."""
    if reduction == "mean":
        return lambda t: t.div_(size)
    if reduction == "majority":
        if scale is not None:
            return lambda t: t.sign_().mul_(scale.to(t.dtype))
        return lambda t: t.sign_()
    return None


def _vote_scale(comp: Compressor, payloads: Sequence[Payload]) -> Tensor | None:
    """The compressor's scale of a majority vote over ``payloads`` (scaled signSGD), if any."""
    scale = getattr(comp, "vote_scale", None)
    return None if scale is None else scale(payloads)


def _decode(comp: Compressor, per_tensor: Sequence[Sequence[Payload]], results: list[Tensor],
            reduction: str, size: int) -> list[Tensor]:
    """Every rank's payloads of tensor i decoded and summed (rank order) into result i."""
    for payloads, res in zip(per_tensor, results):
        scale = _vote_scale(comp, payloads) if reduction == "majority" else None
        decode_sum(comp, payloads, res.view(-1), _finish(reduction, size, scale))
    return results


def _allreduce(comm: Communicator, tensors: Sequence[Tensor], results: list[Tensor],
               reduction: str) -> Handle[list[Tensor]]:
    """Full precision: one in-place allreduce per result (a copy of its input first)."""
    handles = []
    for t, res in zip(tensors, results):
        if res.data_ptr() != t.data_ptr():
            res.copy_(t)
        handles.append(primitives.allreduce(comm, res, average=reduction == "mean"))
    vote = reduction == "majority"
    return Handle.gather(handles, "allreduce").then(
        lambda _: [r.sign_() for r in results] if vote else results)
