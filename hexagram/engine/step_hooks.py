"""The wrapper's optimizer hooks and the step's one host read of its checks.

The engine hooks every optimizer it is given (``optimizers=`` or
``attach_optimizers``): the step pre-hook reads the step's checks (the engine's non-finite
flag and the algorithms' queued conditions, one host read; see
:func:`hexagram.engine.checks.read_step_checks`), then the algorithm's ``before_step``; the
post-hook runs its ``after_step``. A gradient algorithm may be wrapped without optimizers:
until one is attached, the same read runs at the end of backward instead, so a NaN/Inf
gradient still raises, once per step, naming the step and the parameter.

Example::

    model = hx.DistributedDataParallel(net, algorithm="topk")   # read at end of backward
    model.attach_optimizers(opt)                                # read at opt.step() now
"""

from __future__ import annotations

from typing import Any

import torch

from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.engine import lifecycle
from hexagram.engine.checks import read_step_checks
from hexagram.engine.optimizers import needs_optimizers, unwrap_optimizers
from hexagram.engine.reducer import Reducer

__all__ = ["OptimizerHooks"]


class OptimizerHooks:
    """Mixin of :class:`~hexagram.engine.ddp.DistributedDataParallel`: optimizer step
    hooks and where the step's checks are read (see the module docstring)."""

    algorithm: Algorithm
    optimizers: list[torch.optim.Optimizer]
    _reducer: Reducer | None
    _ctx: AlgorithmContext
    _hooked: set[int]
    _step_hooks: list[Any]
    _resources: lifecycle.Resources
    _setup_pending: bool
    _amp: bool

    def _before_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._read_step_checks()
        self.algorithm.before_step(optimizer)

    def _read_step_checks(self, at_backward_end: bool = False) -> None:
        """The step's one host read (see :func:`~hexagram.engine.checks.read_step_checks`):
        at the optimizer step, or at the end of backward while no optimizer is hooked."""
        reducer = self._reducer
        guard = reducer.guard if reducer is not None else None
        step = reducer.backward_count - 1 if reducer is not None else 0
        policy = getattr(self.algorithm.config, "on_nonfinite", "raise")
        if read_step_checks(guard, self._ctx.checks, step, policy,
                            scaler_handles_overflow=at_backward_end and self._amp):
            skipped = getattr(self.algorithm, "skipped_steps", None)
            if isinstance(skipped, int):
                self.algorithm.skipped_steps = skipped + 1  # type: ignore[attr-defined]

    def _wire_checks(self) -> None:
        """Where the step's checks are read: at the optimizer step once one is hooked, else
        (a gradient algorithm wrapped without optimizers) at the end of backward, after
        the algorithm's ``after_backward``; without either, by the algorithm itself."""
        at_backward = self._reducer is not None and not self._hooked
        self._ctx.checks.deferred = bool(self._hooked) or at_backward
        if self._reducer is not None:
            self._reducer.on_backward_end = lifecycle.weak_method(
                self._read_step_checks_at_backward_end) if at_backward else None

    def _read_step_checks_at_backward_end(self) -> None:
        self._read_step_checks(at_backward_end=True)

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.algorithm.after_step(optimizer)

    def attach_optimizers(self, *optimizers: Any) -> None:
        """Hook optimizers created (or wrapped) after wrapping; call on every rank.

        Each is a torch optimizer or a known framework wrapper (unwrapped); one already
        attached is skipped. An algorithm that needs an optimizer (local SGD, DiLoCo,
        decentralized, QAdam) is set up with the first one attached.

        Example: ``model = hx.DistributedDataParallel(net, algorithm="local_sgd")``, then
        ``opt = torch.optim.SGD(model.parameters(), lr=0.1); model.attach_optimizers(opt)``.
        """
        for opt in unwrap_optimizers(optimizers):
            if id(opt) in self._hooked:
                continue
            if not any(opt is o for o in self.optimizers):
                self.optimizers.append(opt)
            self._hooked.add(id(opt))
            # the hook holds the wrapper weakly, so an unreferenced wrapper is collected
            pair = (opt.register_step_pre_hook(lifecycle.weak_method(self._before_step)),
                    opt.register_step_post_hook(lifecycle.weak_method(self._after_step)))
            self._step_hooks.append(pair)  # one entry per hooked optimizer
            self._resources.hooks.extend(pair)
        self._wire_checks()  # read at the optimizer step from now on
        if self._setup_pending and (self.optimizers or not needs_optimizers(self.algorithm)):
            self._setup_pending = False
            self.algorithm.setup(self._ctx)
