"""torch.fx tracing for the planner: shape-dependent Python branches resolved on the example.

:func:`trace` is ``torch.fx.symbolic_trace`` with two additions:

- a ``bool()`` of a traced value (``if x.shape[1] > limit:``) is decided by evaluating that
  value on the example inputs (they may live on ``"meta"``); the graph keeps the branch taken
  for those shapes (the plan is for them anyway), while sizes stay symbolic operators, so
  micro-batches of other sizes still run;
- models fx cannot trace raise :class:`UntraceableModelError` naming the failing source
  line and operation and how to get around it (a leaf module, or ``Constraints``).

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Guarded(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = nn.Linear(4, 2)
    ...     def forward(self, x):
    ...         if x.shape[1] > 8:
    ...             raise ValueError("too wide")
    ...         return self.fc(x)
    >>> gm = trace(Guarded(), (torch.zeros(3, 4),))
    >>> [n.op for n in gm.graph.nodes][-2:]
    ['call_module', 'output']
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch import fx, nn

from hexagram.errors import HexagramError

__all__ = ["UntraceableModelError", "trace"]


class UntraceableModelError(HexagramError):
    """torch.fx cannot capture the model (the message names the operation and the way out)."""


class _ExampleTracer(fx.Tracer):
    """Decides ``bool(proxy)`` by running the proxy's ancestors on the example inputs."""

    def __init__(self, inputs: tuple[Any, ...], leaves: tuple[type, ...]) -> None:
        super().__init__()
        self.inputs, self.leaves = inputs, leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, self.leaves) or super().is_leaf_module(m, qualname)

    def _value(self, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
        if node in env:
            return env[node]
        args = fx.node.map_arg(node.args, lambda n: self._value(n, env))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: self._value(n, env))
        if node.op == "placeholder":
            names = [n for n in self.graph.nodes if n.op == "placeholder"]
            value = self.inputs[names.index(node)]
        elif node.op == "get_attr":
            value = self.root
            for part in str(node.target).split("."):
                value = getattr(value, part)
        elif node.op == "call_module":
            value = self.root.get_submodule(str(node.target))(*args, **kwargs)
        elif node.op == "call_method":
            value = getattr(args[0], str(node.target))(*args[1:], **kwargs)
        else:
            value = node.target(*args, **kwargs)  # type: ignore[operator]
        env[node] = value
        return value

    def to_bool(self, obj: fx.Proxy) -> bool:
        with torch.no_grad():
            return bool(self._value(obj.node, {}))


def _where(exc: BaseException) -> str:
    """``file:line: code`` of the innermost frame outside torch (the model's own code)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and not f.filename.endswith("trace.py")]
    if not frames:
        return "(unknown line)"
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {(f.line or '').strip()}"


def trace(model: nn.Module, inputs: tuple[Any, ...],
          leaf_modules: tuple[type, ...] = ()) -> fx.GraphModule:
    """Trace ``model`` (see the module doc); ``leaf_modules``: module types kept whole."""
    tracer = _ExampleTracer(inputs, leaf_modules)
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # fx raises TraceError, TypeError, RuntimeError, ...
        raise UntraceableModelError(
            f"torch.fx cannot capture {type(model).__name__}: {type(exc).__name__}: {exc} "
            f"at {_where(exc)}. Make the module doing this a leaf (plan(..., "
            f"leaf_modules=(TheModule,)): kept whole, replicated, never split across "
            f"stages), or rewrite that operation") from exc
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    gm.graph.eliminate_dead_code()  # e.g. the comparisons decided by to_bool
    gm.recompile()
    return gm
