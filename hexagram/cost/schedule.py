"""The messages an algorithm sends per step, and their wire bytes, derived from its objects.

A *schedule* lists, per bucket, the collectives one step issues and the bytes this rank
sends in each (the same formulas the primitives count with, so the sum equals the
algorithm's ``bytes_sent()`` per step; ``tests/test_cost_wire.py`` checks it for every
registered gradient algorithm). Payload sizes are not guessed: each segment is compressed
once with a copy of the algorithm's own compressor, so the bytes follow its configuration
(density, levels, chunking, rank) whatever class implements it. Inside
:func:`analytic_payloads` (the simulator) sizes come from the formulas of
:mod:`hexagram.cost.payload_size` instead, equal to the compressed ones (tested) and
thousands of times cheaper; classes without a formula are still compressed.

How a compressed algorithm communicates is read from its compressor's ``aggregation``:
``SUM`` (element-wise summable) -> an allreduce of each payload tensor; ``SUM`` not
element-wise (low-rank factors) -> two allreduces, all first factors then all second
factors of a bucket; ``SCATTER_GATHER`` without error feedback -> all-to-all of P chunk
payloads then allgather of the reduced chunk; ``GATHER`` (or scatter-gather with error
feedback) -> allgather of the payloads. An algorithm whose protocol is its own (gTop-k's
tree, random-k's shared positions, QAdam's momentum, robust shards) gives its messages
itself (``wire_messages``, :mod:`hexagram.cost.facts`); this module never imports one.

Example:
    >>> import hexagram as hx
    >>> layout = [[TensorSpec("w", (1000, 100))]]
    >>> msgs = bucket_schedule(hx.algorithms.get("allreduce"), layout[0], world=4)
    >>> [(m.op, m.sent) for m in msgs]
    [('allreduce', 600000)]
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from hexagram.compress.base import Aggregation, Compressor, Payload
from hexagram.cost.facts import Message, Priced, TensorSpec, compressor_of
from hexagram.cost.payload_size import meta_payload

__all__ = ["Message", "TensorSpec", "allreduce_messages", "analytic_payloads",
           "bucket_schedule", "is_lossy", "layout_of", "payload_of", "ring_sent",
           "segment_shapes", "sizing_times", "step_end_messages", "step_schedule",
           "wire_bytes"]


Layout = Sequence[Sequence[TensorSpec]]


def layout_of(buckets: Sequence[Any]) -> list[list[TensorSpec]]:
    """The engine's buckets (``DistributedDataParallel.buckets``) as specs, launch order."""
    return [[TensorSpec(e.name, tuple(e.shape), e.param.element_size()) for e in b.entries]
            for b in buckets]


def is_lossy(algorithm: Priced) -> bool:
    """True if ``algorithm`` changes the gradient's sum (it carries a compressor)."""
    return compressor_of(algorithm) is not None


def ring_sent(nbytes: int, world: int) -> int:
    """Bytes a rank sends in a ring allreduce of ``nbytes``: ``2 (P - 1) n / P``."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0



_PAYLOADS: dict[tuple[str, str, tuple[int, ...]], Payload] = {}
_ANALYTIC: ContextVar[bool] = ContextVar("hexagram_analytic_payloads", default=False)
_META: dict[tuple[type, str, tuple[int, ...]], Payload | None] = {}


@contextmanager
def analytic_payloads() -> Iterator[None]:
    """Within the block, :func:`payload_of` derives sizes from shapes and configs
    (:func:`hexagram.cost.payload_size.meta_payload`: tensors on the ``meta`` device, the
    same shapes and dtypes as real payloads) instead of compressing random tensors, and
    records no timings for :func:`sizing_times`. What the simulator uses; ``auto`` keeps
    compressing, since it times the job's compressors on the way.

    Example:
        >>> import hexagram.compress as hc
        >>> with analytic_payloads():
        ...     payload_of(hc.get("fp16"), (1000, 100)).tensors[0].device.type
        'meta'
    """
    token = _ANALYTIC.set(True)
    try:
        yield
    finally:
        _ANALYTIC.reset(token)


def payload_of(compressor: Compressor, shape: Sequence[int]) -> Payload:
    """The payload ``compressor`` makes of a float32 tensor of ``shape`` (a copy compresses
    random data, so the live compressor's state is untouched; sizes depend only on shape
    and config). Inside :func:`analytic_payloads`: the same layout on the ``meta`` device,
    from formulas, where the compressor's class has one."""
    name = (type(compressor).__qualname__, repr(getattr(compressor, "config", None)))
    if _ANALYTIC.get():
        meta_key = (type(compressor), name[1], tuple(shape))
        if meta_key not in _META:
            _META[meta_key] = meta_payload(compressor, shape)
        if (meta := _META[meta_key]) is not None:
            return meta
    key = (*name, tuple(shape))
    if key not in _PAYLOADS:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(*shape, generator=gen) if len(shape) else torch.randn(1)
        comp = copy.deepcopy(compressor)
        t0 = time.thread_time()
        payload = comp.compress(x, gen)
        t1 = time.thread_time()
        comp.decompress(payload)
        # the sizing pass doubles as a timing of this compressor on the job's own shapes, in
        # CPU seconds (ranks sizing at once on shared cores would inflate wall time)
        _TIMES.setdefault(name, []).append((x.numel(), t1 - t0, time.thread_time() - t1))
        _PAYLOADS[key] = Payload(tuple(t.detach() for t in payload.tensors),
                                 torch.Size(shape), torch.float32)
    return _PAYLOADS[key]


_TIMES: dict[tuple[str, str], list[tuple[int, float, float]]] = {}


def sizing_times(compressor: Compressor) -> list[tuple[int, float, float]]:
    """``(numel, compress s, decompress s)`` of every shape :func:`payload_of` sized with
    ``compressor``'s configuration so far (CPU seconds of this process's thread, on CPU
    tensors, at the time it ran)."""
    return list(_TIMES.get((type(compressor).__qualname__,
                            repr(getattr(compressor, "config", None))), []))


def segment_shapes(algorithm: Priced, bucket: Sequence[TensorSpec]) -> list[tuple[int, ...]]:
    """Shapes of the bucket's segments as the algorithm cuts them (layer or whole bucket)."""
    if algorithm.granularity == "bucket":
        return [(sum(t.numel for t in bucket),)]
    return [t.shape for t in bucket]


def _generic(algorithm: Priced, comp: Compressor, bucket: Sequence[TensorSpec],
             world: int) -> list[Message]:
    """Messages of a compressed algorithm from its compressor's aggregation."""
    shapes = segment_shapes(algorithm, bucket)
    feedback = getattr(algorithm, "error_feedback", None) is not None
    if comp.aggregation is Aggregation.SUM and comp.payload_sums_elementwise:
        return [Message("allreduce", ring_sent(t.numel() * t.element_size(), world))
                for s in shapes for t in payload_of(comp, s).tensors]
    if comp.aggregation is Aggregation.SUM:
        return _factor_allreduces(algorithm, comp, shapes, world)
    if comp.aggregation is Aggregation.SCATTER_GATHER and not feedback:
        chunk = [payload_of(comp, (-(-math.prod(s) // world),)).nbytes for s in shapes]
        first = (world - 1) * (world * sum(chunk)) // world
        return [Message("alltoall", first), Message("allgather", (world - 1) * sum(chunk))]
    total = sum(payload_of(comp, s).nbytes for s in shapes)
    return [Message("allgather", (world - 1) * total)]


def _factor_allreduces(algorithm: Priced, comp: Compressor, shapes: list[tuple[int, ...]],
                       world: int) -> list[Message]:
    """Low-rank: one allreduce of every first factor (+ the segments not worth
    compressing, dense), then one of every second factor."""
    worthwhile = getattr(comp, "worthwhile", None)
    layer = getattr(algorithm.config, "granularity", "layer") == "layer"
    first = second = 0
    for s in shapes:
        ok = not (layer and len(s) < 2) and (worthwhile is None or worthwhile(torch.Size(s)))
        if not ok:
            first += math.prod(s) * 4
            continue
        p, q = payload_of(comp, s).tensors[:2]
        first += p.numel() * p.element_size()
        second += q.numel() * q.element_size()
    return [Message("allreduce", ring_sent(first, world)),
            Message("allreduce", ring_sent(second, world))]


def allreduce_messages(algorithm: Priced, bucket: Sequence[TensorSpec], world: int,
                       rank: int = 0, hosts: int = 1) -> list[Message]:
    """Flat ring allreduce, or (``hierarchical``, several ranks per host) reduce to the host
    leader, allreduce among leaders, broadcast back: a leader sends
    ``(ranks per host - 1) n + ring(n, hosts)``, the others ``n``."""
    nbytes = sum(t.numel * t.itemsize for t in bucket)
    per_host = world // max(hosts, 1)
    if getattr(algorithm.config, "hierarchical", False) and per_host > 1:
        leader = rank % per_host == 0
        sent = (per_host - 1) * nbytes + ring_sent(nbytes, hosts) if leader else nbytes
        return [Message("hierarchical", sent, rounds=3)]
    return [Message("allreduce", ring_sent(nbytes, world))]


def _at_step(algorithm: Priced, comp: Compressor, step: int) -> Compressor:
    """The compressor in use at ``step`` when the density ramps up (DGC's warm-up: the
    algorithm's public ``density_at(step)``), else ``comp``."""
    density_at = getattr(algorithm, "density_at", None)
    cfg = getattr(comp, "config", None)
    if not callable(density_at) or cfg is None or not hasattr(cfg, "density"):
        return comp
    density = float(density_at(step))
    if density == cfg.density:
        return comp
    key = (type(comp).__qualname__, repr(cfg), density)
    if key not in _AT_STEP:
        _AT_STEP[key] = type(comp)(dataclasses.replace(cfg, density=density))  # type: ignore[call-arg]
    return _AT_STEP[key]


_AT_STEP: dict[tuple[str, str, float], Compressor] = {}


def bucket_schedule(algorithm: Priced, bucket: Sequence[TensorSpec], world: int,
                    step: int = 10**9, hosts: int = 1, rank: int = 0) -> list[Message]:
    """The messages of one bucket at training step ``step`` (default: after any warm-up),
    sent by ``rank`` (ranks differ only in trees and hierarchical allreduce) of ``world``
    ranks on ``hosts`` hosts.

    Raises:
        ValueError: a weight algorithm (see :func:`hexagram.cost.model.amortized`).
    """
    algorithm = algorithm.priced_as()  # delay=1 sends its inner algorithm's messages
    if algorithm.kind != "grad":
        raise ValueError(f"{algorithm.name!r} communicates weights, not per-bucket gradients;"
                         " use hexagram.cost.model.amortized for it")
    if world <= 1:
        return []
    start = getattr(algorithm.config, "start_iter", 0)  # full-precision warm-up steps
    comp = compressor_of(algorithm)
    if step < start:
        return allreduce_messages(algorithm, bucket, world, rank, hosts)
    own = algorithm.wire_messages(bucket, world, rank)
    if own is not None:
        return own
    if comp is None:
        return allreduce_messages(algorithm, bucket, world, rank, hosts)
    comp = _at_step(algorithm, comp, step)
    return _generic(algorithm, comp, bucket, world)


def step_end_messages(algorithm: Priced, world: int, step: int = 10**9, rank: int = 0
                      ) -> list[Message]:
    """The messages a gradient algorithm sends once per step after its last bucket's
    (its ``step_messages``: gTop-k's fault agreement), none during a warm-up or alone."""
    algorithm = algorithm.priced_as()
    own = getattr(algorithm, "step_messages", None)  # optional (hexagram.cost.facts)
    if own is None or algorithm.kind != "grad" or world <= 1 \
            or step < getattr(algorithm.config, "start_iter", 0):
        return []
    return list(own(world, rank))


def step_schedule(algorithm: Priced, layout: Layout, world: int, step: int = 10**9,
                  hosts: int = 1, rank: int = 0) -> list[list[Message]]:
    """:func:`bucket_schedule` of every bucket, in launch order; after the last one, the
    engine's once-per-step agreement on non-finite gradients (an allreduce of one int64,
    :class:`hexagram.engine.guard.FiniteGuard`) where the algorithm's reduction neither
    carries a NaN/Inf to every rank nor drops its sender itself, then the algorithm's own
    once-per-step messages (:func:`step_end_messages`)."""
    out = [bucket_schedule(algorithm, b, world, step, hosts, rank) for b in layout]
    if out and world > 1 and algorithm.kind == "grad" \
            and not getattr(algorithm, "passes_nonfinite", False) \
            and not getattr(algorithm, "drops_nonfinite", False):
        out[-1] = [*out[-1], Message("allreduce", ring_sent(8, world))]
    if out:
        out[-1] = [*out[-1], *step_end_messages(algorithm, world, step, rank)]
    return out


def wire_bytes(algorithm: Priced, layout: Layout, world: int, step: int = 10**9,
               hosts: int = 1, rank: int = 0) -> int:
    """Bytes ``rank`` sends in one step (what its ``bytes_sent()`` grows by)."""
    return sum(m.sent for msgs in step_schedule(algorithm, layout, world, step, hosts, rank)
               for m in msgs)
