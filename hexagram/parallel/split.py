"""Pipeline stages of any fx-traceable model: one ``fx.GraphModule`` per stage.

The traced graph's nodes are assigned to stages by the planner's layers (the same grouping
as :func:`hexagram.parallel.graph.capture`): a tensor operator goes to the stage holding its
layer; other nodes (sizes, parameters read directly) go to the first stage that uses them.
Stage ``k`` takes, in graph order, every value made before it and used from it on (skip and
residual connections pass through the stages in between) and returns those needed after it;
the last stage returns the model's output. Parameter names stay the model's own.

Example:
    >>> stages = split_stages(model, x, plan)             # doctest: +SKIP
    >>> out = stages[1](*stages[0](x))  # the model's forward, in two parts  # doctest: +SKIP
    >>> boundaries(model, x, plan)[0]   # what crosses: shapes, dtypes, batch dims  # doctest: +SKIP
    [Boundary(shape=(8, 16), dtype=torch.float64, batch=True)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp

from hexagram.errors import HexagramError
from hexagram.parallel.graph import group_nodes
from hexagram.parallel.plans import Plan

__all__ = ["Boundary", "boundaries", "split_stages"]


@dataclass(frozen=True)
class Boundary:
    """A tensor stage ``k`` hands to stage ``k + 1``: its shape for the example inputs
    (dim 0 is the example's global batch when ``batch``), its dtype, and whether dim 0 is
    the batch (split over data parallelism) or a size independent of it (e.g. positions)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    batch: bool


def _assign(gm: fx.GraphModule, keys: dict[fx.Node, str], plan: Plan) -> dict[fx.Node, int]:
    layer_stage = {name: k for k, st in enumerate(plan.stages)
                   for name in plan.layer_names[st.layers[0]:st.layers[1]]}
    last = len(plan.stages) - 1
    stage: dict[fx.Node, int] = {}
    for node in reversed(gm.graph.nodes):  # users before producers
        if node.op == "placeholder":
            stage[node] = 0
        elif node.op == "output":
            stage[node] = last
        elif keys.get(node) in layer_stage:
            stage[node] = layer_stage[keys[node]]
        else:
            stage[node] = min((stage[u] for u in node.users), default=last)
    for node in gm.graph.nodes:
        late = [a for a in node.all_input_nodes if stage[a] > stage[node]]
        if late:
            stage[node] = max(stage[a] for a in late)  # computed where its inputs are
    return stage


def _stage_graph(gm: fx.GraphModule, stage: dict[fx.Node, int], k: int, last: int
                 ) -> fx.Graph:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    nodes = list(gm.graph.nodes)
    live_in = [n for n in nodes if stage[n] < k and any(stage[u] >= k for u in n.users)]
    if k == 0:
        live_in = [n for n in nodes if n.op == "placeholder"]
    for n in live_in:
        env[n] = g.placeholder(n.name)
    for n in nodes:
        if stage[n] == k and n.op not in ("placeholder", "output"):
            env[n] = g.node_copy(n, lambda a: env[a])
    if k == last:
        out = next(n for n in nodes if n.op == "output")
        g.output(fx.node.map_arg(out.args[0], lambda a: env[a]))
    else:
        g.output(tuple(env[n] for n in _crossing(gm, stage, k)))
    return g


def _check_tensors(gm: fx.GraphModule, stage: dict[fx.Node, int]) -> None:
    for n in gm.graph.nodes:
        crossing = n.op != "output" and any(stage[u] > stage[n] for u in n.users)
        if crossing and "tensor_meta" not in n.meta:
            raise HexagramError(
                f"{n.format_node()} crosses a pipeline stage boundary but is not a tensor "
                f"(torch.distributed.pipelining sends tensors only): plan with "
                f"Constraints(pp=1), or make the module computing it a leaf module")
        if n.op == "get_attr" and len({stage[u] for u in n.users}) > 1:
            raise HexagramError(f"parameter {n.target} is used by several pipeline stages "
                                f"(shared weights): plan with Constraints(pp=1)")


def _crossing(gm: fx.GraphModule, stage: dict[fx.Node, int], k: int) -> list[fx.Node]:
    """Values stage ``k`` hands on, in the order its graph returns them."""
    return [n for n in gm.graph.nodes
            if n.op != "output" and stage[n] <= k and any(stage[u] > k for u in n.users)]


def _grown(example_inputs: Any, batch: int, mode: FakeTensorMode) -> tuple[Any, ...]:
    """The example inputs with their batch dimension doubled (fake tensors of ``mode``)."""
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            x = mode.from_tensor(x)
            if x.dim() and x.shape[0] == batch:
                with mode:
                    x = torch.cat([x, x])
        out.append(x)
    return tuple(out)


def boundaries(model: nn.Module, example_inputs: Any, plan: Plan,
               leaf_modules: tuple[type, ...] = ()) -> list[list[Boundary]]:
    """Per stage boundary ``k -> k + 1``, the tensors crossing it, in the order stage ``k``
    returns them (:func:`split_stages`) and stage ``k + 1`` takes them. Batch dims are found
    by propagating shapes a second time (fake tensors) with the batch doubled."""
    gm, where, _first = group_nodes(model, example_inputs, leaf_modules)
    keys = {node: key for node, (key, _op) in where.items()}
    stage = _assign(gm, keys, plan)
    _check_tensors(gm, stage)
    first = {n: n.meta["tensor_meta"] for n in gm.graph.nodes if "tensor_meta" in n.meta}
    batch = int(next(iter(first.values())).shape[0])
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    ShapeProp(gm, fake_mode=mode).propagate(*_grown(example_inputs, batch, mode))
    out = []
    for k in range(len(plan.stages) - 1):
        row = []
        for n in _crossing(gm, stage, k):
            a, b = first[n], n.meta["tensor_meta"]
            is_batch = bool(a.shape) and b.shape[0] == 2 * a.shape[0]
            row.append(Boundary(tuple(a.shape), a.dtype, is_batch))
        out.append(row)
    return out


def split_stages(model: nn.Module, example_inputs: Any, plan: Plan,
                 leaf_modules: tuple[type, ...] = ()) -> list[fx.GraphModule]:
    """One GraphModule per stage of ``plan`` (see the module doc)."""
    gm, where, _first = group_nodes(model, example_inputs, leaf_modules)
    keys = {node: key for node, (key, _op) in where.items()}
    stage = _assign(gm, keys, plan)
    _check_tensors(gm, stage)
    last = len(plan.stages) - 1
    return [fx.GraphModule(gm, _stage_graph(gm, stage, k, last), f"stage{k}")
            for k in range(last + 1)]
