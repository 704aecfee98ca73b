"""Measurements ``auto`` agrees on across ranks: compressor costs and the compute profile.

Every rank measures on its own; the values are reduced to the slowest rank's (MAX), so all
ranks predict the same numbers and the decision holds for the slowest one.

Example::

    costs = compressor_costs(candidates, static_profile(buckets, specs), world, group)
    compute = slowest(recorder.profile(2), group)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hexagram.comm.device import group_tensor
from hexagram.cost.facts import Priced, compressor_of
from hexagram.cost.model import MB, bucket_layout
from hexagram.cost.profile import (
    CompressorCost,
    ComputeProfile,
    TreeCost,
    measure_compressor,
)
from hexagram.cost.schedule import TensorSpec, layout_of, step_schedule

__all__ = ["agree_costs", "compressor_costs", "local_costs", "slowest", "static_profile"]


def static_profile(buckets: Sequence[Any], specs: Sequence[TensorSpec]) -> ComputeProfile:
    """No compute measured yet: every gradient ready at once, in the engine's bucket order
    (communication and CPU only)."""
    order = [s for bucket in layout_of(buckets) for s in bucket] or list(reversed(specs))
    return ComputeProfile(0.0, 0.0, 0.0, order, [0.0] * len(order))


def compressor_costs(candidates: Sequence[tuple[str, Priced]], profile: ComputeProfile,
                     world: int, group: Any, device: torch.device | str = "cpu"
                     ) -> dict[str, CompressorCost]:
    """Each candidate's compressor timed on this model's own tensor shapes, the slowest
    rank's (:func:`local_costs`). Collective."""
    return agree_costs(local_costs(candidates, profile, world, device), group)


def local_costs(candidates: Sequence[tuple[str, Priced]], profile: ComputeProfile,
                world: int, device: torch.device | str = "cpu") -> dict[str, CompressorCost]:
    """Each candidate's compressor timed on this process, on ``device``, at two of the
    model's own tensor shapes (a middle one and the largest: per-element costs grow once a
    tensor leaves the caches, so generic small sizes under-predict big layers), the best
    of 2 runs each (:func:`hexagram.cost.profile.measure_compressor`), through error
    feedback where the algorithm has it (its encode then also decodes locally). Sizing every
    candidate's payloads on the way warms each compressor up (first calls are slow).
    Algorithms with CPU of their own outside the compressor (gTop-k's tree, QAdam's
    momentum arithmetic: their ``own_work_cost``, :mod:`hexagram.cost.facts`) get it timed
    at the same shapes."""
    out: dict[str, CompressorCost] = {}
    layout = [specs for specs, _ in bucket_layout(profile, 25 * MB, MB)]
    sizes = _timing_shapes([t.shape for t in profile.tensors])
    for label, algorithm in candidates:
        comp = compressor_of(algorithm)
        if comp is None:
            continue
        if algorithm.kind == "grad":
            step_schedule(algorithm, layout, world)
        feedback = _has_feedback(algorithm)
        out[label] = measure_compressor(comp, device, sizes=sizes, feedback=feedback)
        if algorithm.own_work:
            out[label] = dataclasses.replace(out[label],
                                             tree=algorithm.own_work_cost(sizes, device))
    return out


def _has_feedback(algorithm: Priced) -> bool:
    """True if ``algorithm`` encodes through error feedback: an
    :class:`~hexagram.compress.feedback.ErrorFeedback` as ``error_feedback`` (the compressed
    algorithms) or ``feedback`` (QAdam's, on its momentum: corrected, compressed, decoded
    locally, residual written, as the timed feedback encode does)."""
    from hexagram.compress.feedback import ErrorFeedback

    return any(isinstance(getattr(algorithm, attr, None), ErrorFeedback)
               for attr in ("error_feedback", "feedback"))


def _timing_shapes(shapes: Sequence[tuple[int, ...]]
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A middle-sized and the largest of ``shapes`` (two distinct sizes for the line)."""
    by_size = sorted(set(shapes), key=math.prod)
    if not by_size or math.prod(by_size[-1]) <= 32 * 32:
        return (32, 32), (512, 512)
    middle = by_size[len(by_size) // 2]
    if math.prod(middle) >= math.prod(by_size[-1]):
        middle = (32, 32)
    return middle, by_size[-1]


def agree_costs(costs: dict[str, CompressorCost], group: Any) -> dict[str, CompressorCost]:
    """The slowest rank's costs (same labels, and a tree cost for the same ones, on every
    rank: each rank times the same candidates). Collective."""
    labels = sorted(costs)
    vec = group_tensor([v for lb in labels for v in _row(costs[lb])], group)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    rows = vec.view(-1, 8).tolist() if labels else []
    return {lb: CompressorCost((r[0], r[1]), (r[2], r[3]),
                               None if costs[lb].tree is None else
                               TreeCost((r[4], r[5]), (r[6], r[7])))
            for lb, r in zip(labels, rows)}


def _row(cost: CompressorCost) -> tuple[float, ...]:
    tree = cost.tree or TreeCost((0.0, 0.0), (0.0, 0.0))
    return (*cost.compress, *cost.decompress, *tree.once, *tree.per_round)


def slowest(profile: ComputeProfile, group: Any) -> ComputeProfile:
    """``profile`` with every time replaced by its maximum over ranks. Collective."""
    names = [s.name for s in profile.tensors]
    ready = dict(zip(names, profile.ready_s))
    spec = sorted(names)
    cpu = -1.0 if profile.cpu_s is None else profile.cpu_s
    vec = group_tensor([profile.forward_s, profile.backward_s, profile.update_s, cpu,
                        *[ready[n] for n in spec]], group)  # on the group's device
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    got = vec.tolist()  # one read, once per profile
    merged = dict(zip(spec, got[4:]))
    order = sorted(profile.tensors, key=lambda s: merged[s.name])
    return ComputeProfile(got[0], got[1], got[2], order,
                          [merged[s.name] for s in order], got[3] if got[3] >= 0 else None)
