"""Measurements ``auto`` agrees on across ranks: compressor costs and the compute profile.

Every rank measures on its own; the values are reduced to the slowest rank's (MAX), so all
ranks predict the same numbers and the decision holds for the slowest one.

Example::

    costs = compressor_costs(candidates, static_profile(buckets, specs), world, group)
    compute = slowest(recorder.profile(2), group)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hexagram.algorithms.base import Algorithm
from hexagram.cost.model import MB, bucket_layout
from hexagram.cost.profile import (
    CompressorCost,
    ComputeProfile,
    cost_from_times,
    measure_compressor,
)
from hexagram.cost.schedule import (
    TensorSpec,
    _compressor,
    layout_of,
    sizing_times,
    step_schedule,
)

__all__ = ["agree_costs", "compressor_costs", "slowest", "static_profile"]


def static_profile(buckets: Sequence[Any], specs: Sequence[TensorSpec]) -> ComputeProfile:
    """No compute measured yet: every gradient ready at once, in the engine's bucket order
    (communication and CPU only)."""
    order = [s for bucket in layout_of(buckets) for s in bucket] or list(reversed(specs))
    return ComputeProfile(0.0, 0.0, 0.0, order, [0.0] * len(order))


def compressor_costs(candidates: Sequence[tuple[str, Algorithm]], profile: ComputeProfile,
                     world: int, group: Any, device: torch.device | str = "cpu"
                     ) -> dict[str, CompressorCost]:
    """Each candidate's compressor timed on this model's own tensor shapes: sizing every
    candidate's payloads (needed for the wire bytes anyway) times them. Collective."""
    out: dict[str, CompressorCost] = {}
    layout = [specs for specs, _ in bucket_layout(profile, 25 * MB, MB)]
    for label, algorithm in candidates:
        comp = _compressor(algorithm)
        if comp is None:
            continue
        if algorithm.kind == "grad":
            step_schedule(algorithm, layout, world)
        out[label] = cost_from_times(sizing_times(comp)) or measure_compressor(comp, device)
    return agree_costs(out, group)


def agree_costs(costs: dict[str, CompressorCost], group: Any) -> dict[str, CompressorCost]:
    """The slowest rank's costs (same labels on every rank). Collective."""
    labels = sorted(costs)
    vec = torch.tensor([v for lb in labels for v in (*costs[lb].compress,
                                                     *costs[lb].decompress)],
                       dtype=torch.float64)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    rows = vec.view(-1, 4).tolist() if labels else []
    return {lb: CompressorCost((r[0], r[1]), (r[2], r[3])) for lb, r in zip(labels, rows)}


def slowest(profile: ComputeProfile, group: Any) -> ComputeProfile:
    """``profile`` with every time replaced by its maximum over ranks. Collective."""
    names = [s.name for s in profile.tensors]
    ready = dict(zip(names, profile.ready_s))
    spec = sorted(names)
    cpu = -1.0 if profile.cpu_s is None else profile.cpu_s
    vec = torch.tensor([profile.forward_s, profile.backward_s, profile.update_s, cpu,
                        *[ready[n] for n in spec]], dtype=torch.float64)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    merged = dict(zip(spec, vec[4:].tolist()))
    order = sorted(profile.tensors, key=lambda s: merged[s.name])
    return ComputeProfile(float(vec[0]), float(vec[1]), float(vec[2]), order,
                          [merged[s.name] for s in order], float(vec[3]) if vec[3] >= 0 else None)
