"""``plan(model, example_inputs, cluster)``: capture, intra-op ILP, inter-op DP, a Plan.

Example:
    >>> import torch
    >>> from hexagram.parallel.models import mlp_stack
    >>> m = mlp_stack(layers=4, hidden=256, in_features=64, classes=10, device="meta")
    >>> p = plan(m, torch.zeros(32, 64, device="meta"),
    ...          cluster=Cluster(hosts=1, devices_per_host=2, device_memory_gb=1))
    >>> p.devices
    2
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hexagram.errors import HexagramError
from hexagram.parallel.cluster import Cluster, Constraints
from hexagram.parallel.graph import Layer, ModelGraph, capture
from hexagram.parallel.inter import StageChoice, build_tables, solve
from hexagram.parallel.intra import LayerOption
from hexagram.parallel.plans import Plan, StagePlan
from hexagram.parallel.relax_cost import planned_options

__all__ = ["NoPlanFitsError", "microbatch_choices", "plan", "plan_graph", "to_plan"]


class NoPlanFitsError(HexagramError, MemoryError):
    """No plan fits the devices' memory (the message gives needed vs available bytes)."""


def microbatch_choices(batch: int, cons: Constraints, limit: int = 32) -> list[int]:
    """Powers of two dividing the batch (or the imposed count)."""
    if cons.microbatches:
        if batch % cons.microbatches:
            raise HexagramError(f"Constraints.microbatches={cons.microbatches} does not divide "
                                f"the global batch {batch}")
        return [cons.microbatches]
    return [b for b in (2 ** k for k in range(12)) if b <= min(batch, limit) and batch % b == 0]


def _layouts(layer: Layer, opt: LayerOption) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """Where each resharding happens at run time: folded into the adjacent nn.Linear."""
    picks, ops = opt.picks, layer.ops
    lay: dict[int, list[str]] = {i: [p.in_layout, p.out_layout.replace("P", "R")]
                                 for i, p in enumerate(picks) if ops[i].kind == "linear"}
    blockers = []
    edges = [(u, v) for v, op in enumerate(ops) for u in op.inputs] + [(len(ops) - 1, -1)]
    for u, v in edges:
        have, want = picks[u].out_layout, "R" if v < 0 else picks[v].in_layout
        if have == want:
            continue
        if u in lay:      # the producing linear hands over the wanted layout
            lay[u][1] = want
        elif v in lay:    # the consuming linear accepts what it is given
            lay[v][0] = have
        else:
            blockers.append(f"{ops[u].target}->{ops[v].target if v >= 0 else 'output'} "
                            f"needs {have}->{want} between non-linear operators")
    return {ops[i].target: (a, b) for i, (a, b) in lay.items()}, blockers


def _stage_plan(graph: ModelGraph, st: StageChoice, first_rank: int,
                blockers: list[str]) -> StagePlan:
    shard: dict[str, str] = {}
    layouts: dict[str, tuple[str, str]] = {}
    sharded = 0
    for layer, opt in zip(graph.layers[st.start:st.end], st.options):
        for op, pick in zip(layer.ops, opt.picks):
            if op.kind == "linear":
                shard[op.target] = pick.name + ("+zero" if pick.zero else "")
            elif op.kind in ("embedding", "norm", "unknown") and pick.zero:
                shard[op.target] = "replicate+zero"
            sharded += pick.name == "sharded"
        lay, block = _layouts(layer, opt)
        layouts.update(lay)
        blockers += block
    return StagePlan(layers=(st.start, st.end),
                     ranks=list(range(first_rank, first_rank + st.sub.devices)),
                     dp=st.mesh.d, tp=st.mesh.t, latency_s=st.latency, memory_bytes=st.memory,
                     shardings=shard, layouts=layouts, sharded_ops=sharded,
                     dp_algorithm=st.mesh.dp_algorithm,
                     dp_options=planned_options(st.mesh.dp_algorithm))


def to_plan(graph: ModelGraph, cluster: Cluster, microbatches: int, schedule: str,
            stages: list[StageChoice], step: float) -> Plan:
    """Turn the passes' result into a declarative :class:`Plan`."""
    out, rank, blockers = [], 0, list[str]()
    for st in stages:
        out.append(_stage_plan(graph, st, rank, blockers))
        rank += st.sub.devices
    return Plan(cluster=cluster, stages=out, microbatches=microbatches,
                global_batch=graph.batch, step_time_s=step, schedule=schedule,
                layer_names=[layer.name for layer in graph.layers],
                unknown_ops=graph.unknown, params=graph.params, blockers=blockers)


def _least_memory(graph: ModelGraph, cluster: Cluster) -> float:
    """Bytes per device of the most memory-frugal layout: every layer on its own stage with
    all devices, ZeRO-sharded (a lower bound the error message can quote)."""
    state = graph.params * (2 * cluster.dtype_bytes + cluster.optimizer_bytes)
    biggest = max(layer.out_elems for layer in graph.layers) * cluster.dtype_bytes
    return state / cluster.devices + biggest


def plan_graph(graph: ModelGraph, cluster: Cluster, constraints: Constraints | None = None,
               cache: dict[Any, Any] | None = None) -> Plan:
    """Plan an already captured graph (see :func:`plan`)."""
    cons = constraints or Constraints()
    cons.validate(cluster)
    cache = {} if cache is None else cache
    n_layers = len(graph.layers)
    counts = [cons.pp] if cons.pp else list(range(1, min(n_layers, cluster.devices) + 1))
    if cons.pp and cons.pp > n_layers:
        raise HexagramError(f"Constraints.pp={cons.pp} exceeds the model's {n_layers} layers")
    best: tuple[float, int, list[StageChoice]] | None = None
    for b in microbatch_choices(graph.batch, cons):
        tables = build_tables(graph, cluster, cons, b, cache)
        # torch's 1F1B needs at least as many micro-batches as stages
        usable = [s for s in counts if cons.schedule == "gpipe" or s <= b]
        found = solve(tables, cluster.devices, usable) if usable else None
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], b, found[1])
    if best is None:
        raise NoPlanFitsError(
            f"no plan fits in memory: the best plan needs at least "
            f"{_least_memory(graph, cluster) / 1e9:.3g} GB per device, devices have "
            f"{cluster.device_memory_gb:.3g} GB; add devices or memory, shrink the model or "
            f"the batch (global batch {graph.batch})")
    return to_plan(graph, cluster, best[1], cons.schedule, best[2], best[0])


def plan(model: nn.Module, example_inputs: Any, cluster: Cluster,
         constraints: Constraints | None = None, leaf_modules: tuple[type, ...] = ()) -> Plan:
    """Plan intra- and inter-operator parallelism of ``model`` for ``cluster``.

    Args:
        model: an ``nn.Module`` torch.fx can trace; may live on the ``"meta"`` device.
        example_inputs: the inputs of one training step (its batch is the global batch).
        cluster: the devices and links to plan for.
        constraints: degrees to impose (pipeline stages, tp, dp, micro-batches, schedule).
        leaf_modules: module types fx keeps whole (replicated, never split).

    Raises:
        NoPlanFitsError: nothing fits in memory (needed vs available bytes per device).
        UntraceableModelError: fx cannot capture the model (names the operation).
    """
    if not isinstance(cluster, Cluster):
        raise HexagramError(f"cluster must be a hexagram.parallel.Cluster, got "
                            f"{type(cluster).__name__}")
    return plan_graph(capture(model, example_inputs, leaf_modules=leaf_modules), cluster,
                      constraints)
