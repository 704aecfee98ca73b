"""Hand-made strategies evaluated by the planner's own cost model.

Each strategy fixes the degrees (``pp`` stages of equal layer counts, ``dp x tp`` inside a
stage), the per-operator rule (Megatron's column/row alternation when ``tp > 1``) and
whether parameters are ZeRO-sharded; only the micro-batch count is tuned (the best that
fits). They are the yardstick of the planner: data parallel, ZeRO, tensor parallel inside
a host, pipeline only, and 3D combinations.

Example:
    >>> import torch
    >>> from hexagram.parallel.graph import capture
    >>> from hexagram.parallel.models import mlp_stack
    >>> g = capture(mlp_stack(layers=4, hidden=64, in_features=8, classes=2, device="meta"),
    ...             torch.zeros(16, 8, device="meta"))
    >>> r = evaluate_fixed(g, Cluster(hosts=1, devices_per_host=2), pp=1, dp=2, tp=1)
    >>> r is not None and r.stages[0].dp == 2
    True
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hexagram.parallel.cluster import Cluster, Constraints, Submesh
from hexagram.parallel.cost import Mesh
from hexagram.parallel.graph import ModelGraph
from hexagram.parallel.inter import StageChoice, step_time, transfer_time
from hexagram.parallel.intra import megatron
from hexagram.parallel.planner import microbatch_choices, to_plan
from hexagram.parallel.plans import Plan

__all__ = ["Baseline", "baselines", "evaluate_fixed"]


@dataclass(frozen=True)
class Baseline:
    """A named hand-made strategy and its plan (None: it fits no memory / shape)."""

    name: str
    plan: Plan | None


def _submesh(n: int, cluster: Cluster) -> Submesh | None:
    m = cluster.devices_per_host
    if n <= m:
        return Submesh(1, n) if m % n == 0 else None
    return Submesh(n // m, m) if n % m == 0 else None


def _split(n_layers: int, pp: int) -> list[tuple[int, int]]:
    bounds = [round(k * n_layers / pp) for k in range(pp + 1)]
    return list(itertools.pairwise(bounds))


def _stages(graph: ModelGraph, cluster: Cluster, pp: int, dp: int, tp: int, zero: bool,
            b: int, schedule: str) -> list[StageChoice] | None:
    sub = _submesh(dp * tp, cluster)
    b_mb = graph.batch // b
    if sub is None or b_mb % dp or tp > cluster.devices_per_host:
        return None
    mesh = Mesh(cluster=cluster, d=dp, t=tp, b=b_mb // dp, microbatches=b,
                spans_hosts=sub.hosts > 1)
    out = []
    for k, (i, j) in enumerate(_split(len(graph.layers), pp)):
        opts = tuple(megatron(layer, mesh, zero) for layer in graph.layers[i:j])
        inflight = b if schedule == "gpipe" else min(pp - k, b)
        memory = sum(o.state + inflight * o.act for o in opts)
        if memory > cluster.memory_bytes:
            return None
        send = 0.0 if j == len(graph.layers) else transfer_time(
            cluster, sub, graph.layers[j - 1].out_elems * b_mb * cluster.dtype_bytes)
        out.append(StageChoice(i, j, sub, mesh, opts, sum(o.time for o in opts) + send,
                               memory))
    return out


def evaluate_fixed(graph: ModelGraph, cluster: Cluster, pp: int, dp: int, tp: int,
                   zero: bool = False, schedule: str = "1f1b") -> Plan | None:
    """The hand-made plan with these degrees at its best micro-batch count (None: no fit)."""
    if pp * dp * tp != cluster.devices or pp > len(graph.layers):
        return None
    best: Plan | None = None
    for b in microbatch_choices(graph.batch, Constraints()):
        if schedule == "1f1b" and b < pp:
            continue
        stages = _stages(graph, cluster, pp, dp, tp, zero, b, schedule)
        if stages is None:
            continue
        step = step_time([s.latency for s in stages], b, cluster)
        if best is None or step < best.step_time_s:
            best = to_plan(graph, cluster, b, schedule, stages, step)
    return best


def _best(plans: list[Plan | None]) -> Plan | None:
    found = [p for p in plans if p is not None]
    return min(found, key=lambda p: p.step_time_s) if found else None


def baselines(graph: ModelGraph, cluster: Cluster) -> list[Baseline]:
    """Data parallel, ZeRO-3, tensor parallel in a host (+ dp across hosts), pipeline only,
    and the best 3D (pp x dp x tp, with or without ZeRO) combination."""
    n, m = cluster.devices, cluster.devices_per_host
    out = [Baseline("data parallel", evaluate_fixed(graph, cluster, 1, n, 1)),
           Baseline("ZeRO-3", evaluate_fixed(graph, cluster, 1, n, 1, zero=True)),
           Baseline("tensor parallel (host)", evaluate_fixed(graph, cluster, 1, n // m, m)),
           Baseline("pipeline only", evaluate_fixed(graph, cluster, n, 1, 1))]
    combos = []
    tp = 1
    while tp <= m:
        for pp in range(1, n // tp + 1):
            if (n // tp) % pp == 0:
                for zero in (False, True):
                    combos.append(evaluate_fixed(graph, cluster, pp, n // tp // pp, tp, zero))
        tp *= 2
    out.append(Baseline("best 3D (pp x dp x tp)", _best(combos)))
    return out
