"""Timestamps of a job's own training steps, for ``auto``'s compute profile and watch.

A :class:`StepRecorder` hooks the wrapped module (forward end) and every trainable
parameter (gradient ready); the algorithm calls :meth:`StepRecorder.forward_start` from
``before_forward``, :meth:`StepRecorder.backward_done` from ``after_backward`` and wraps its
delegate's ``bucket_ready`` in :meth:`StepRecorder.communicating`, so time spent starting
communication (compression on the training thread) is taken out of the ready times: what
remains is the model's own backward. A step's row is complete at the next forward.

On CUDA the stamps are CUDA events on the training stream, not the host clock: once the
hot path has no host syncs the host only sees kernel launches, long before the GPU runs
them. A row is added once its events have completed (checked without blocking, so rows
arrive a step or two late); :meth:`StepRecorder.profile` waits for the pending ones.

Example::

    rec = StepRecorder(module, named_params)
    rec.forward_start(); ...; rec.backward_done(); rec.forward_start()
    rec.rows[-1].step_s, rec.profile(last=2)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hexagram.cost.profile import ComputeProfile
from hexagram.cost.schedule import TensorSpec

__all__ = ["DriftWatch", "StepRecorder", "StepRow"]


@dataclass
class StepRow:
    """One finished step (seconds): forward, when each gradient was ready after the
    forward ended, the end of backward's communication, and the whole step."""

    forward_s: float
    ready: dict[str, float]
    after_backward_s: float  # since the forward started
    step_s: float  # forward start to next forward start
    update_s: float = field(default=0.0)
    cpu_s: float = field(default=0.0)  # the training thread's CPU, communication left out


class _Clock:
    """Host seconds on the CPU; CUDA events (recorded on the current stream) on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def between(self, a: Any, b: Any) -> float:
        """Seconds from stamp ``a`` to stamp ``b`` (both completed on CUDA)."""
        return float(a.elapsed_time(b)) / 1000.0 if self.cuda else float(b - a)

    def done(self, stamp: Any, wait: bool) -> bool:
        if not self.cuda:
            return True
        if wait:
            stamp.synchronize()
        return bool(stamp.query())


class StepRecorder:
    """Records forward/backward/ready times of the job's steps (see module doc); keeps the
    last :attr:`KEEP` rows (auto reads at most the last few: a run of 100k steps must not
    hold 100k rows of per-parameter times)."""

    KEEP = 64

    def __init__(self, module: nn.Module, named: Sequence[tuple[str, nn.Parameter]]) -> None:
        self.specs = [TensorSpec(n, tuple(p.shape), p.element_size()) for n, p in named]
        self.rows: list[StepRow] = []
        self._clock = _Clock(named[0][1].device if named else torch.device("cpu"))
        self._pending: list[tuple[Any, ...]] = []  # finished steps whose events may run
        self._inside = 0.0
        self._inside_cpu = 0.0
        self._cpu0 = 0.0
        self._start: Any = None
        self._fwd_end: Any = None
        self._after: Any = None
        self._marks: dict[str, Any] = {}
        self._hooks: list[Any] = [module.register_forward_hook(self._forward_end)]
        self._hooks += [p.register_post_accumulate_grad_hook(self._marker(n)) for n, p in named]

    def close(self) -> None:
        """Remove every hook."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _forward_end(self, *_: Any) -> None:
        self._fwd_end = self._clock.now()

    def _marker(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            # host clock: the training thread's own communication time taken out; CUDA
            # events on the training stream see only its kernels (communication runs on
            # the communicators' streams)
            self._marks[name] = self._clock.now() if self._clock.cuda \
                else time.perf_counter() - self._inside
        return hook

    @contextmanager
    def communicating(self) -> Iterator[None]:
        """Time inside this block is not compute (a delegate's hooks: compression,
        starting and finishing communication)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self._inside += time.perf_counter() - t0
            self._inside_cpu += time.thread_time() - c0

    def forward_start(self) -> None:
        """Called before every forward: closes the previous step's row."""
        now, cpu = self._clock.now(), time.thread_time()
        if self._start is not None and self._after is not None and self._fwd_end is not None:
            self._pending.append((self._start, self._fwd_end, self._marks, self._after, now,
                                  cpu - self._cpu0 - self._inside_cpu))
            self._drain(wait=False)
        self._start, self._fwd_end, self._after, self._cpu0 = now, None, None, cpu
        self._marks, self._inside, self._inside_cpu = {}, 0.0, 0.0

    def _drain(self, wait: bool) -> None:
        """Turn finished steps whose stamps have completed into rows, in order."""
        clock = self._clock
        while self._pending and clock.done(self._pending[0][4], wait):
            start, fwd_end, marks, after, end, cpu_s = self._pending.pop(0)
            ready = {n: clock.between(fwd_end, t) if clock.cuda else t - fwd_end
                     for n, t in marks.items()}
            self.rows.append(StepRow(clock.between(start, fwd_end), ready,
                                     clock.between(start, after), clock.between(start, end),
                                     clock.between(after, end), cpu_s))
            if len(self.rows) > 2 * self.KEEP:  # amortized: one cut every KEEP steps
                del self.rows[:-self.KEEP]

    def backward_done(self) -> None:
        """Called after backward's communication finished."""
        self._after = self._clock.now()

    def profile(self, last: int) -> ComputeProfile:
        """Medians over the last ``last`` rows (at least one row needed); on CUDA it first
        waits for the steps whose events are still running."""
        self._drain(wait=True)
        rows = self.rows[-last:]
        if not rows:
            raise RuntimeError("no complete step recorded yet")
        fwd = statistics.median(r.forward_s for r in rows)
        upd = statistics.median(r.update_s for r in rows)
        ready = {s.name: statistics.median(max(0.0, r.ready.get(s.name, 0.0)) for r in rows)
                 for s in self.specs}
        order = sorted(self.specs, key=lambda s: ready[s.name])
        backward = max(ready.values(), default=0.0)
        cpu = statistics.median(r.cpu_s for r in rows)
        return ComputeProfile(fwd, backward, upd, order, [ready[s.name] for s in order], cpu)


class DriftWatch:
    """Counts consecutive steps whose time is off ``expected`` by more than ``drift``
    (relative). Without an expected time, the median of the 2nd-4th steps observed sets it
    (the first after a rebuild is not typical).

    >>> w = DriftWatch(0.25, expected=1.0)
    >>> for s in (1.1, 1.5, 1.6, 0.9, 2.0, 2.0):
    ...     w.observe(s)
    >>> w.drifting
    2
    """

    def __init__(self, drift: float, expected: float | None = None) -> None:
        self.drift = drift
        self.restart(expected)

    def restart(self, expected: float | None = None) -> None:
        """A new normal (None: learn it from the next steps); the count starts over."""
        self.expected = expected
        self.drifting = 0
        self._seen: list[float] = []

    def observe(self, step_s: float) -> None:
        if self.expected is None:
            self._seen.append(step_s)
            if len(self._seen) >= 4:
                self.expected = statistics.median(self._seen[-3:])
            return
        off = abs(step_s / self.expected - 1.0) > self.drift
        self.drifting = self.drifting + 1 if off else 0
