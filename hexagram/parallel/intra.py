"""Intra-operator pass: an ILP over each operator's sharding strategies (Alpa section 4).

For one layer on one logical mesh: a one-hot binary per operator over its strategies, and
per edge a transport variable over (producer layout, consumer layout) pairs whose marginals
are the two operators' choices; minimise node costs (compute, collectives, gradient sync)
plus resharding costs, subject to a per-device memory bound. The layer input and output
are replicated over ``t`` (Megatron's convention), so layers decouple and identical layers
share one solve.

:func:`layer_options` returns a few Pareto options (fast ... small) obtained by tightening
the memory bound; the stage pass picks among them.

Example:
    >>> import torch
    >>> from hexagram.parallel.cluster import Cluster
    >>> from hexagram.parallel.cost import Mesh
    >>> from hexagram.parallel.graph import capture
    >>> from hexagram.parallel.models import mlp_stack
    >>> g = capture(mlp_stack(layers=1, hidden=4096, in_features=8, classes=2, device="meta"),
    ...             torch.zeros(8, 8, device="meta"))
    >>> mesh = Mesh(cluster=Cluster(hosts=1, devices_per_host=8), d=1, t=8, b=8, microbatches=1)
    >>> [s.name for s in layer_options(g.layers[1], mesh)[0].picks[1:4]]
    ['colwise', 'sharded', 'rowwise']
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hexagram.parallel.cost import Mesh, Strategy, edge_cost, strategies
from hexagram.parallel.graph import Layer
from hexagram.parallel.solver import Row, solve

__all__ = ["LayerOption", "evaluate", "fastest", "layer_options", "megatron"]


@dataclass(frozen=True)
class LayerOption:
    """One layer's sharding on a mesh: per-op strategies, time per micro-batch, memory."""

    picks: tuple[Strategy, ...]
    time: float
    state: float
    act: float


def _edges(layer: Layer) -> list[tuple[int, int]]:
    return [(u, v) for v, op in enumerate(layer.ops) for u in dict.fromkeys(op.inputs)]


def evaluate(layer: Layer, mesh: Mesh, picks: list[Strategy]) -> LayerOption:
    """Cost of a fixed assignment (nodes + resharding + turning the output replicated)."""
    time = sum(s.time for s in picks)
    for u, v in _edges(layer):
        time += edge_cost(picks[u].out_layout, picks[v].in_layout, layer.ops[u].out_elems, mesh)
    time += edge_cost(picks[-1].out_layout, "R", layer.ops[-1].out_elems, mesh)
    return LayerOption(tuple(picks), time, sum(s.state for s in picks),
                       sum(s.act for s in picks))


def _build(layer: Layer, mesh: Mesh, cands: list[list[Strategy]]
           ) -> tuple[list[float], list[Row], int, list[tuple[int, int]]]:
    """Objective, constraints, #binaries and the (op, strategy) of each binary."""
    index = [(i, k) for i, ss in enumerate(cands) for k in range(len(ss))]
    col = {ik: n for n, ik in enumerate(index)}
    last = len(cands) - 1
    c = [cands[i][k].time + (edge_cost(cands[i][k].out_layout, "R", layer.ops[i].out_elems, mesh)
                             if i == last else 0.0) for i, k in index]
    rows: list[Row] = [({col[i, k]: 1.0 for k in range(len(ss))}, 1.0, 1.0)
                       for i, ss in enumerate(cands)]
    for u, v in _edges(layer):
        lu = sorted({s.out_layout for s in cands[u]})
        lv = sorted({s.in_layout for s in cands[v]})
        # the executor reshards only at an nn.Linear (DTensor styles): between two other
        # operators the layout must not change
        rigid = layer.ops[u].kind != "linear" and layer.ops[v].kind != "linear"
        z = {}
        for a in lu:  # transport variable z[a, b]: producer gives a, consumer takes b
            for b in lv:
                if not (rigid and a != b):
                    z[a, b] = len(c)
                    c.append(edge_cost(a, b, layer.ops[u].out_elems, mesh))
        for a in lu:  # sum_b z[a, b] = [u's strategy outputs a]
            coeffs = {z[a, b]: 1.0 for b in lv if (a, b) in z}
            coeffs.update({col[u, k]: -1.0 for k, s in enumerate(cands[u]) if s.out_layout == a})
            rows.append((coeffs, 0.0, 0.0))
        for b in lv:  # sum_a z[a, b] = [v's strategy takes b]
            coeffs = {z[a, b]: 1.0 for a in lu if (a, b) in z}
            coeffs.update({col[v, k]: -1.0 for k, s in enumerate(cands[v]) if s.in_layout == b})
            rows.append((coeffs, 0.0, 0.0))
    return c, rows, len(index), index


def _solve(layer: Layer, mesh: Mesh, cands: list[list[Strategy]], budget: float,
           memory_objective: bool = False) -> LayerOption | None:
    c, rows, nb, index = _build(layer, mesh, cands)
    mem = {n: cands[i][k].state + cands[i][k].act for n, (i, k) in enumerate(index)}
    if math.isfinite(budget):
        rows.append((mem, -math.inf, budget))
    if memory_objective:  # minimise memory, time only breaks ties
        scale = 1e-6 / max(1e-30, max(abs(v) for v in c))
        c = [v * scale + mem.get(n, 0.0) / max(1.0, max(mem.values())) for n, v in
             enumerate(c)]
    x = solve(c, rows, nb)
    if x is None:
        return None
    picks = [cands[i][k] for n, (i, k) in enumerate(index) if x[n] > 0.5]
    return evaluate(layer, mesh, picks)


def _candidates(layer: Layer, mesh: Mesh) -> list[list[Strategy]]:
    """Strategies per op; a non-linear last op must hand on the replicated layer output."""
    cands = [strategies(layer, i, mesh) for i in range(len(layer.ops))]
    if layer.ops[-1].kind != "linear":
        cands[-1] = [s for s in cands[-1] if s.out_layout == "R"]
    return cands


def fastest(layer: Layer, mesh: Mesh) -> LayerOption:
    """The ILP's optimum without a memory bound."""
    cands = _candidates(layer, mesh)
    best = _solve(layer, mesh, cands, math.inf)
    assert best is not None  # unconstrained: the all-replicated assignment is feasible
    return best


def layer_options(layer: Layer, mesh: Mesh, levels: int = 3,
                  best: LayerOption | None = None) -> list[LayerOption]:
    """Pareto options: fastest, then tighter memory bounds, then the smallest memory."""
    cands = _candidates(layer, mesh)
    options = [best or fastest(layer, mesh)]
    smallest = _solve(layer, mesh, cands, math.inf, memory_objective=True)
    floor = smallest.state + smallest.act if smallest else 0.0
    for level in range(1, levels):
        top = options[-1].state + options[-1].act
        if top <= floor * 1.001:
            break
        opt = _solve(layer, mesh, cands, floor + (top - floor) * 0.5 ** level)
        if opt is not None and opt.state + opt.act < top:
            options.append(opt)
    if smallest is not None and smallest.state + smallest.act < \
            options[-1].state + options[-1].act:
        options.append(smallest)
    return options


def megatron(layer: Layer, mesh: Mesh, zero: bool = False) -> LayerOption:
    """The hand-made Megatron rule: a linear fed by a sharded tensor is row-split, any other
    linear column-split; ops whose inputs are all sharded stay sharded; the rest replicate."""
    picks: list[Strategy] = []
    for i, op in enumerate(layer.ops):
        cands = [s for s in strategies(layer, i, mesh) if s.zero == (zero and bool(op.params))
                 or not op.params or mesh.d == 1]
        sharded_in = bool(op.inputs) and all(picks[u].out_layout == "S" for u in op.inputs)
        want = {"linear": "rowwise" if sharded_in else "colwise"}.get(
            op.kind, "sharded" if sharded_in else "replicate")
        picks.append(next((s for s in cands if s.name == want), cands[0]))
    return evaluate(layer, mesh, picks)
