"""Graph capture: torch.fx trace + shape propagation, operators grouped into layers.

Trace with :func:`torch.fx.symbolic_trace` (modules and inputs may live on the ``"meta"``
device, so a 48-layer GPT costs no memory), propagate shapes, classify each operator into a
kind the cost model knows, and group operators into layers by their top-level module (the
children of an ``nn.Sequential``). Sizes are per sample (the example batch is divided out).

Example:
    >>> import torch
    >>> from hexagram.parallel.models import mlp_stack
    >>> g = capture(mlp_stack(layers=2, hidden=8, in_features=4, classes=3, device="meta"),
    ...             torch.zeros(5, 4, device="meta"))
    >>> [len(layer.ops) for layer in g.layers], g.layers[1].ops[1].kind
    ([2, 5, 5, 2], 'linear')
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from hexagram.parallel.trace import trace

__all__ = ["Layer", "ModelGraph", "Op", "capture"]

_ELEMENTWISE_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity)
_NORM_MODULES = (nn.LayerNorm, nn.RMSNorm, nn.Softmax)
_VIEW_MODULES = (nn.Flatten, nn.Unflatten)
_ELEMENTWISE_FUNCS: set[Callable[..., Any]] = {
    operator.add, operator.mul, operator.sub, operator.truediv, torch.add, torch.mul, torch.relu,
    torch.tanh, torch.sigmoid, F.relu, F.gelu, F.silu, F.dropout}
_ELEMENTWISE_METHODS = {"add", "mul", "sub", "div", "relu", "tanh", "sigmoid", "float", "to"}
_VIEW_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "flatten", "unsqueeze",
                 "squeeze", "expand"}


@dataclass
class Op:
    """One operator of a layer. Sizes are elements per sample unless named ``const``.

    Attributes:
        kind: ``input``, ``linear``, ``embedding``, ``norm``, ``elementwise``, ``view``,
            ``attention``, ``source`` (no tensor input, e.g. arange) or ``unknown``.
        target: module path (``"3.attn.q"``) or function name.
        inputs: indices (in the layer) of the operators producing its tensor inputs.
        out_elems, out_const: output elements per sample, and those not scaling with batch.
        flops: forward FLOPs per sample; params: parameter count.
    """

    kind: str
    target: str
    inputs: list[int] = field(default_factory=list)
    out_elems: float = 0.0
    out_const: float = 0.0
    flops: float = 0.0
    params: int = 0


@dataclass
class Layer:
    """Operators of one top-level child; op 0 is the layer's input (boundary, replicated)."""

    name: str
    ops: list[Op]

    @property
    def params(self) -> int:
        return sum(op.params for op in self.ops)

    @property
    def out_elems(self) -> float:
        """Elements per sample of the layer's output (its last operator)."""
        return self.ops[-1].out_elems + self.ops[-1].out_const

    def signature(self) -> tuple[Any, ...]:
        """Equal for structurally identical layers (their ILPs are solved once)."""
        return tuple((o.kind, tuple(o.inputs), o.out_elems, o.out_const, o.flops, o.params)
                     for o in self.ops)


@dataclass
class ModelGraph:
    """The captured model: its layers in order and the example batch size."""

    layers: list[Layer]
    batch: int
    unknown: list[str] = field(default_factory=list)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)


def _module_kind(mod: nn.Module) -> str:
    if isinstance(mod, nn.Linear):
        return "linear"
    if isinstance(mod, nn.Embedding):
        return "embedding"
    if isinstance(mod, _NORM_MODULES):
        return "norm"
    if isinstance(mod, _ELEMENTWISE_MODULES):
        return "elementwise"
    return "view" if isinstance(mod, _VIEW_MODULES) else "unknown"


def _kind(node: fx.Node, modules: dict[str, nn.Module]) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "call_module":
        return _module_kind(modules[str(node.target)])
    if node.op == "call_method":
        if node.target in _VIEW_METHODS:
            return "view"
        return "elementwise" if node.target in _ELEMENTWISE_METHODS else "unknown"
    if node.target is F.scaled_dot_product_attention:
        return "attention"
    if node.target in (F.layer_norm, F.softmax, torch.softmax):
        return "norm"
    if node.target in _ELEMENTWISE_FUNCS:
        return "elementwise"
    return "unknown"


def _numel(node: fx.Node) -> tuple[int, int] | None:
    """(elements, leading dim) of a node's tensor output, None if it is not one tensor."""
    meta = node.meta.get("tensor_meta")
    if meta is None or not hasattr(meta, "shape"):
        return None
    shape = tuple(meta.shape)
    return math.prod(shape), (shape[0] if shape else 1)


def _flops(kind: str, node: fx.Node, mod: nn.Module | None, elems: float) -> float:
    if kind == "linear" and isinstance(mod, nn.Linear):
        return 2.0 * mod.in_features * elems        # elems = rows x out_features
    if kind == "attention":
        q, k = (a.meta["tensor_meta"].shape for a in node.all_input_nodes[:2])
        return 4.0 * math.prod(q) * k[-2]             # QK^T and AV: 2 x 2 x B h T S d
    return {"norm": 5.0, "elementwise": 1.0, "unknown": 1.0}.get(kind, 0.0) * elems


def _layer_key(node: fx.Node) -> str | None:
    """Path of the outermost module the node runs in (``"3"``, ``"blocks.3"``), if any."""
    stack = node.meta.get("nn_module_stack") or {}
    for key in stack:
        return str(key)
    return str(node.target) if node.op == "call_module" else None


def _make_op(node: fx.Node, modules: dict[str, nn.Module], batch: int) -> Op | None:
    size = _numel(node)
    if node.op == "output" or (size is None and node.op != "placeholder"):
        return None
    elems, lead = size if size is not None else (0, 0)
    batched = lead == batch
    kind = _kind(node, modules)
    if kind == "input" or not any(_numel(a) for a in node.all_input_nodes):
        kind = "input" if node.op == "placeholder" else "source"
    mod = modules.get(str(node.target)) if node.op == "call_module" else None
    params = sum(p.numel() for p in mod.parameters()) if mod is not None else 0
    per = elems / batch if batched else 0.0
    const = 0.0 if batched else float(elems)
    target = str(node.target) if node.op == "call_module" else getattr(
        node.target, "__name__", str(node.target))
    if kind == "unknown" and mod is not None:
        target = f"{target} ({type(mod).__name__})"
    return Op(kind=kind, target=target, out_elems=per, out_const=const,
              flops=_flops(kind, node, mod, elems) / batch, params=params)


def capture(model: nn.Module, example_inputs: Any, warn: bool = True,
            leaf_modules: tuple[type, ...] = ()) -> ModelGraph:
    """Trace ``model`` on ``example_inputs`` (a tensor or tuple; "meta" is fine).

    Operators the planner does not know are kept (replicated, costed as elementwise) and a
    warning names each of them once. ``leaf_modules``: module types traced as one operator.

    Raises:
        UntraceableModelError: fx cannot capture the model (names the operation).
    """
    _gm, where, first = group_nodes(model, example_inputs, leaf_modules)
    layers: dict[str, list[tuple[fx.Node, Op]]] = {}
    for node, (key, op) in where.items():
        layers.setdefault(key, [(node, first[key])]).append((node, op))
    batch = int(_as_tuple(example_inputs)[0].shape[0])
    return _finish(layers, batch, warn)


def _as_tuple(example_inputs: Any) -> tuple[Any, ...]:
    return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)


Grouped = tuple[fx.GraphModule, dict[fx.Node, tuple[str, Op]], dict[str, Op]]


def group_nodes(model: nn.Module, example_inputs: Any,
                leaf_modules: tuple[type, ...] = ()) -> Grouped:
    """The traced model; per tensor-producing node (its layer key, its :class:`Op`): a node
    belongs to its outermost module, else to its first producer's layer, else to the
    previous node's (nodes without one tensor output are left out); per layer key, the
    layer's input op (op 0: the tensors entering it)."""
    inputs = _as_tuple(example_inputs)
    batch = int(inputs[0].shape[0])
    gm = trace(model, inputs, leaf_modules)
    ShapeProp(gm).propagate(*inputs)
    modules = dict(gm.named_modules())
    where: dict[fx.Node, tuple[str, Op]] = {}
    index: dict[fx.Node, int] = {}
    sizes: dict[str, int] = {}
    entering: set[tuple[str, fx.Node]] = set()  # tensors already counted as a layer's input
    first: dict[str, Op] = {}
    last_key = None
    for node in gm.graph.nodes:
        op = _make_op(node, modules, batch)
        if op is None:
            continue
        producers = [a for a in node.all_input_nodes if a in where]
        key = _layer_key(node) or (where[producers[0]][0] if producers else last_key) or "input"
        if key not in sizes:
            sizes[key] = 1
            first[key] = Op(kind="input", target=f"{key}.input")
        for a in producers:
            src_key = where[a][0]
            op.inputs.append(index[a] if src_key == key else 0)
            if src_key != key and (key, a) not in entering:  # part of the layer's input
                entering.add((key, a))
                first[key].out_elems += where[a][1].out_elems
        where[node], index[node] = (key, op), sizes[key]
        sizes[key] += 1
        last_key = key
    return gm, where, first


def _finish(layers: dict[str, list[tuple[fx.Node, Op]]], batch: int, warn: bool) -> ModelGraph:
    out, unknown = [], []
    for key, pairs in layers.items():
        ops = [op for _node, op in pairs]
        if key == "input" or (len(ops) == 2 and ops[1].kind == "input"):
            continue  # the model's own placeholders: not a layer
        for op in ops:
            if op.kind == "input" and op.out_elems == 0 and op is not ops[0]:
                op.kind = "source"
        out.append(Layer(name=key, ops=ops))
        unknown += [op.target for op in ops if op.kind == "unknown"]
    unknown = list(dict.fromkeys(unknown))
    if warn:
        for name in unknown:
            warnings.warn(f"hexagram.parallel: operator {name!r} is unknown to the planner; "
                          f"it stays replicated (costed as elementwise)", stacklevel=3)
    return ModelGraph(layers=out, batch=batch, unknown=unknown)
