"""The one training loop of the measurement tools: a step, its clock, faults, evaluation.

Every measurement trains through :class:`Loop`: ``hexagram bench``'s step times
(:mod:`hexagram.bench.worker`), ``hexagram train``'s time to accuracy
(:mod:`hexagram.bench.trainloop`, Byzantine runs included) and live mode under failures
(:mod:`hexagram.bench.live`, :mod:`hexagram.bench.soak`). Per step, :meth:`Loop.run` tells
the watchdog which step runs, fires this rank's fault due at the step, and times the step
alone: its clock counts training steps only, never data loading or evaluation between them.

The step itself is one of two: :func:`train_step` (forward, loss, backward, the optimizer's
step, the wrapper's after-step hook, ``zero_grad``) or :func:`live_step` (live mode's
``trainer.run_step(closure)``, which votes and may drop the step). :class:`Progress` and
:func:`run_epochs` evaluate between steps, agree the metric and the clock over the ranks,
and stop at a target, after the epochs or past a time limit: the same decision, at the same
step, on every rank.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> loop = Loop(step=train_step(model, opt, nn.functional.mse_loss))
    >>> for _ in range(3):
    ...     _ = loop.run(torch.ones(4, 2), torch.zeros(4, 1))
    >>> loop.steps, len(loop.times), loop.clock == sum(loop.times)
    (3, 3, True)
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hexagram.bench.watchdog import beat
from hexagram.comm.device import group_tensor
from hexagram.testing.faults import FaultInjector

__all__ = ["Loop", "Progress", "Step", "agree", "eval_marks", "live_step", "run_epochs",
           "train_step"]

#: One training step on a batch ``(x, y)``; returns what the step returns (live mode:
#: whether the step was committed).
Step = Callable[[Any, Any], Any]
#: ``loss(output, target) -> scalar tensor``
Loss = Callable[[Any, Any], Tensor]


def train_step(model: Callable[[Any], Any], optimizer: torch.optim.Optimizer, loss: Loss,
               after_step: Callable[[], None] | None = None) -> Step:
    """The data-parallel step: ``loss(model(x), y).backward()``, ``optimizer.step()``,
    ``after_step()`` (a wrapper's hook: model averaging runs there), ``optimizer.zero_grad()``.
    ``model`` is the wrapped model (its backward communicates). The step returns the loss,
    detached (reading its value is the caller's choice: it syncs a GPU)."""

    def step(x: Any, y: Any) -> Tensor:
        value = loss(model(x), y)
        value.backward()
        optimizer.step()
        if after_step is not None:
            after_step()
        optimizer.zero_grad()
        return value.detach()
    return step


def live_step(trainer: Any, loss: Loss) -> Step:
    """Live mode's step: ``trainer.run_step(closure)`` with the closure
    ``loss(model(x), y).backward()``; returns True when the step was committed, False when
    it was dropped (the membership changed: run it again)."""

    def step(x: Any, y: Any) -> bool:
        return bool(trainer.run_step(lambda model: loss(model(x), y).backward()))
    return step


@dataclass(kw_only=True)
class Loop:
    """Runs and times training steps (see the module doc).

    Attributes:
        step: the step (:func:`train_step`, :func:`live_step`).
        faults: this rank's faults (:mod:`hexagram.testing.faults`), fired at their step.
        inside: ``"NAME:CALL"``: fire a due fault after the CALL-th
            ``torch.distributed.NAME`` of the step instead of before the step (a peer dies
            in the middle of, e.g., an averaging round); ``""``: before the step.
        clock: seconds of the steps run so far (steps only).
        steps: steps run (attempts, in live mode).
        times: seconds of each step, in order (a list given here is appended to).
    """

    step: Step
    faults: FaultInjector | None = None
    inside: str = ""
    clock: float = 0.0
    steps: int = 0
    times: list[float] = field(default_factory=list)

    def run(self, x: Any, y: Any, at: int | None = None) -> Any:
        """One step on ``(x, y)``; ``at``: the training step it is (faults fire by it;
        default: the steps run so far; live mode passes its committed step). Returns what
        the step returns."""
        at = self.steps if at is None else at
        beat(f"training step {at + 1}")
        with self._fault(at):
            start = time.perf_counter()
            out = self.step(x, y)
            took = time.perf_counter() - start
        self.clock += took
        self.steps += 1
        self.times.append(took)
        return out

    def _fault(self, at: int) -> contextlib.AbstractContextManager[None]:
        """The fault due at step ``at``: fired now (before the clock starts), or armed to
        fire inside the step (:attr:`inside`)."""
        if self.faults is None:
            return contextlib.nullcontext()
        fault = self.faults.faults.get(at)
        if fault is None or not self.inside:
            self.faults.at_step(at)
            return contextlib.nullcontext()
        name, _, call = self.inside.partition(":")
        return self.faults.inside(dist, name, rank=self.faults.rank, action=fault.action,
                                  call=int(call or 1), when="after")


def agree(metric: float, clock: float) -> tuple[float, float]:
    """(mean ``metric`` over the ranks, longest ``clock``): the figures every rank's stop
    decision reads, so they all decide alike. Needs the default process group."""
    t = group_tensor([metric, clock])  # on the default group's device (CUDA with NCCL)
    dist.all_reduce(t[:1])
    dist.all_reduce(t[1:], op=dist.ReduceOp.MAX)
    return float(t[0]) / dist.get_world_size(), float(t[1])


@dataclass(kw_only=True)
class Progress:
    """Evaluations between steps and the stop decision.

    Attributes:
        evaluate: this rank's metric now (test accuracy, validation loss).
        reached_by: True for a metric that reaches the target; None: no target.
        time_limit: stop once the agreed training clock passes it (seconds).
        wall: the agreed clock at the last evaluation.
        curve: one point per evaluation: epoch, step, time_s (agreed clock), metric (mean).
        reached: the first point that reached the target, else None.
    """

    evaluate: Callable[[], float]
    reached_by: Callable[[float], bool] | None = None
    time_limit: float = math.inf
    wall: float = 0.0
    curve: list[dict[str, float]] = field(default_factory=list)
    reached: dict[str, float] | None = None

    @property
    def done(self) -> bool:
        """The target was reached or the clock passed the time limit."""
        return self.reached is not None or self.wall > self.time_limit

    def check(self, loop: Loop, epoch: float) -> bool:
        """Evaluate (outside ``loop``'s clock), record the agreed point; returns
        :attr:`done`. Every rank must call it at the same step."""
        metric, self.wall = agree(self.evaluate(), loop.clock)
        point = {"epoch": epoch, "step": loop.steps, "time_s": self.wall, "metric": metric}
        self.curve.append(point)
        if self.reached is None and self.reached_by is not None and self.reached_by(metric):
            self.reached = point
        return self.done


def eval_marks(batches: int, evals: int) -> set[int]:
    """The batches (1-based) of an epoch of ``batches`` after which to evaluate, ``evals``
    times evenly; the last batch always is one.

    Example:
        >>> sorted(eval_marks(10, 3))
        [3, 7, 10]
    """
    return {max(1, round(batches * (k + 1) / evals)) for k in range(evals)}


def run_epochs(loop: Loop, progress: Progress,
               batches: Callable[[int], Sequence[tuple[Any, Any]]], *, epochs: int,
               evals_per_epoch: int) -> None:
    """Evaluate, then train epoch after epoch (``batches(epoch)``), evaluating
    ``evals_per_epoch`` times an epoch (:func:`eval_marks`), until ``progress`` is done or
    ``epochs`` ran. Every rank must call it with as many batches per epoch: the evaluations
    are collectives, and the stop is decided on agreed figures, at the same step everywhere.

    Example (on every rank of a process group):
        >>> progress = Progress(evaluate=lambda: accuracy(model), reached_by=lambda v: v >= 0.9,
        ...                     time_limit=600.0)                     # doctest: +SKIP
        >>> run_epochs(loop, progress, epoch_batches, epochs=5,
        ...            evals_per_epoch=2)                             # doctest: +SKIP
        >>> progress.reached["step"] == loop.steps                    # doctest: +SKIP
        True
    """
    progress.check(loop, 0.0)
    for epoch in range(epochs):
        chunk = batches(epoch)
        marks = eval_marks(len(chunk), evals_per_epoch)
        for i, (x, y) in enumerate(chunk, start=1):
            loop.run(x, y)
            if i in marks and progress.check(loop, epoch + i / len(chunk)):
                return
