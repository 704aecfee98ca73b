"""Frames that ``torch.compile`` runs eagerly, marked without importing ``torch._dynamo``.

``torch.compiler.disable`` imports ``torch._dynamo`` (about 1.7 CPU-s) when it is applied, so
decorating the engine's methods made every process that touches the engine pay it, though
most never compile. :func:`run_eagerly` marks the function the same way with what torch
itself loads: the code object's frame strategy in Dynamo's C extension (the frame, and with
``recursive`` every frame it calls, is skipped by the frame evaluator) and the attributes
that make a tracing Dynamo graph-break at a call to it instead of inlining it. Where the
extension lacks the strategy (another torch), it falls back to ``torch.compiler.disable``.

Example:
    >>> def hooks() -> int:
    ...     return 1
    >>> run_eagerly(hooks, recursive=True)()
    1
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["run_eagerly"]


def run_eagerly(fn: F, recursive: bool) -> F:
    """``fn`` itself, whose frame Dynamo never traces: as ``torch.compiler.disable(fn,
    recursive=recursive)``. ``recursive=False``: the functions it calls are compiled (the
    wrapped module's forward); ``True``: they run eagerly too (the engine's hooks)."""
    try:
        from torch._C._dynamo.eval_frame import (  # type: ignore[attr-defined]
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:
        return torch.compiler.disable(fn, recursive=recursive)  # type: ignore[no-any-return]
    inner = _FrameAction.SKIP if recursive else _FrameAction.DEFAULT
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, inner))
    # a Dynamo that is tracing a caller reads these: it calls fn eagerly (a graph break)
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    fn._torchdynamo_disable_msg = None  # type: ignore[attr-defined]
    fn._torchdynamo_disable_recursive = recursive  # type: ignore[attr-defined]
    return fn
