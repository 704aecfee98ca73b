"""Price a fixed :class:`Plan` again, under any :class:`Cluster`, and split its prediction.

The planner prices plans while it searches; a stored plan keeps only its result. Here the
plan's per-operator choices are rebuilt from the plan itself (each ``nn.Linear``'s sharding
and ``+zero``, each other operator's layout from the layout it receives, as the executor
runs it) and priced with the cost model's own :func:`~hexagram.parallel.intra.evaluate`,
:func:`~hexagram.parallel.inter.transfer_time` and
:func:`~hexagram.parallel.inter.step_time`. Priced under the cluster it was planned for,
the result is the plan's ``step_time_s``; priced under another cluster (re-measured, or
with one term switched off) it answers "what would the model say about *this* plan".

Example:
    >>> import torch
    >>> from hexagram.parallel.cluster import Cluster
    >>> from hexagram.parallel.graph import capture
    >>> from hexagram.parallel.models import mlp_stack
    >>> from hexagram.parallel.planner import plan_graph
    >>> g = capture(mlp_stack(layers=2, hidden=64, in_features=8, classes=2, device="meta"),
    ...             torch.zeros(16, 8, device="meta"))
    >>> c = Cluster(hosts=1, devices_per_host=2)
    >>> p = plan_graph(g, c)
    >>> abs(price(g, p, c) - p.step_time_s) < 1e-12
    True
"""

from __future__ import annotations

from hexagram.errors import HexagramError
from hexagram.parallel.cluster import Cluster, Submesh
from hexagram.parallel.cost import Mesh, Strategy, strategies
from hexagram.parallel.graph import Layer, ModelGraph
from hexagram.parallel.inter import step_time, transfer_time
from hexagram.parallel.intra import evaluate
from hexagram.parallel.plans import Plan, StagePlan
from hexagram.parallel.relax_cost import frozen_options

__all__ = ["breakdown", "price", "stage_latencies"]


def _submesh(devices: int, cluster: Cluster) -> Submesh:
    per_host = cluster.devices_per_host
    return Submesh(1, devices) if devices <= per_host else Submesh(devices // per_host,
                                                                  per_host)


def _pick(layer: Layer, i: int, mesh: Mesh, name: str, zero: bool) -> Strategy:
    for s in strategies(layer, i, mesh):
        if s.name == name and s.zero == zero:
            return s
    raise HexagramError(f"operator {layer.ops[i].target!r} has no strategy {name!r} "
                        f"(zero={zero}) on a {mesh.d}x{mesh.t} mesh: the plan does not "
                        f"belong to this model graph")


def _layer_picks(layer: Layer, mesh: Mesh, stage: StagePlan) -> list[Strategy]:
    """The strategies the plan runs: linears as sharded; other operators on the layout they
    receive (the executor reshards only at linears)."""
    picks: list[Strategy] = []
    layout: list[str] = []  # the layout each operator hands on
    for i, op in enumerate(layer.ops):
        style = stage.shardings.get(op.target, "replicate")
        zero = style.endswith("+zero") and mesh.d > 1
        if op.kind == "linear":
            name = style.removesuffix("+zero") if mesh.t > 1 else "replicate"
            picks.append(_pick(layer, i, mesh, name, zero))
            layout.append(stage.layouts.get(op.target, ("R", "R"))[1])
            continue
        plain = [layout[u] for u in op.inputs if layer.ops[u].kind != "linear"]
        given = plain or [layout[u] for u in op.inputs] or ["R"]
        sharded = given[0] == "S" and mesh.t > 1 and op.kind in ("elementwise", "view",
                                                                  "attention")
        picks.append(_pick(layer, i, mesh, "sharded" if sharded else "replicate", zero))
        layout.append("S" if sharded else "R")
    return picks


def stage_latencies(graph: ModelGraph, plan: Plan, cluster: Cluster) -> list[float]:
    """Seconds per micro-batch of each stage of ``plan`` under ``cluster`` (layers, their
    collectives, amortised gradient sync and the hand-off to the next stage)."""
    if plan.global_batch != graph.batch or plan.stages[-1].layers[1] != len(graph.layers):
        raise HexagramError(f"the plan is for {plan.stages[-1].layers[1]} layers and batch "
                            f"{plan.global_batch}, the graph has {len(graph.layers)} layers "
                            f"and batch {graph.batch}: price the plan with its own model")
    b_mb = graph.batch // plan.microbatches
    out = []
    for k, st in enumerate(plan.stages):
        sub = _submesh(st.dp * st.tp, cluster)
        mesh = Mesh(cluster=cluster, d=st.dp, t=st.tp, b=b_mb // st.dp,
                    microbatches=plan.microbatches, spans_hosts=sub.hosts > 1,
                    dp_algorithm=st.dp_algorithm, dp_options=frozen_options(st.dp_options))
        start, end = st.layers
        total = sum(evaluate(layer, mesh, _layer_picks(layer, mesh, st)).time
                    for layer in graph.layers[start:end])
        if k + 1 < len(plan.stages):
            total += transfer_time(cluster, sub, graph.layers[end - 1].out_elems * b_mb
                                   * cluster.dtype_bytes)
        out.append(total)
    return out


def price(graph: ModelGraph, plan: Plan, cluster: Cluster | None = None) -> float:
    """Predicted seconds per step of ``plan`` under ``cluster`` (default: its own)."""
    c = cluster or plan.cluster
    return step_time(stage_latencies(graph, plan, c), plan.microbatches, c,
                     [st.dp * st.tp for st in plan.stages])


#: the cost model's terms and the Cluster fields that switch each off
_TERMS: dict[str, dict[str, float]] = {
    "op overhead": {"op_overhead_us": 0.0},
    "DTensor": {"tp_overhead_us": 0.0},
    "FSDP2": {"zero_overhead_us": 0.0},
    "pipelining": {"microbatch_overhead_us": 0.0},
    "step": {"step_overhead_us": 0.0},
    "core sharing": {"cores_per_host": 0.0},  # negative: a pipeline's bubble frees cores
    "links": {"intra_latency_us": 0.0, "inter_latency_us": 0.0, "intra_host_gbps": 1e12,
              "inter_host_gbps": 1e12},
}


def breakdown(graph: ModelGraph, plan: Plan, cluster: Cluster | None = None
              ) -> dict[str, float]:
    """Seconds per step of ``plan`` by term: each term is what the step loses when that
    term alone is switched off, ``compute`` what is left with all off, ``total`` the full
    prediction (terms interact through ``max`` in the pipeline formula, so they need not add
    up exactly to ``total``)."""
    c = cluster or plan.cluster
    total = price(graph, plan, c)
    out = {name: total - price(graph, plan, c.replace(**off)) for name, off in _TERMS.items()}
    everything = {k: v for off in _TERMS.values() for k, v in off.items()}
    out["compute"] = price(graph, plan, c.replace(**everything))
    out["total"] = total
    return out
