"""Asynchronous model averaging: a background thread averages weights every N milliseconds.

BAGUA's asynchronous decentralized full-precision relaxation. Training never waits for the
network: a thread, on its own process group and :class:`Communicator` (so it never
interleaves with the main group's collectives), runs *rounds* every ``interval_ms``:

1. a tiny allreduce of ``[active, stop, nonfinite]`` flags (the join/stop protocol, and
   whether a rank found NaN/Inf in the previous round's mean: then every thread stops at
   this round and the training threads raise
   :class:`~hexagram.errors.NonFiniteGradientError` at their next forward pass);
2. snapshot ``s_i`` = my current weights + the correction not yet applied;
3. allreduce-average the snapshots: ``a = mean_j s_j``;
4. add ``a - s_i`` to my pending correction (zero where ``a`` holds NaN/Inf: such a mean
   never reaches the weights).

The training thread adds the pending correction to the parameters at the start of each
forward pass (``before_forward``), never during forward/backward/step, so autograd never sees
weights change under it. Because the correction is a *difference*, local optimizer steps
taken while a round was in flight are kept, and the sum of all ranks' weights is unchanged
by averaging: no update is lost. After ``synchronize()`` every rank holds exactly
``mean_i(x_0 + all local updates of rank i)``, which the tests check.

Stopping: ``abort()`` (collective: call it on every rank) stops the threads after the
current round; ``resume()`` (collective) restarts them. ``synchronize()`` marks this rank
inactive; its thread keeps averaging until every rank is inactive (ranks may finish their
data at different times), then a final allreduce makes all weights identical and the thread
restarts unless aborted. ``close()`` stops the thread for good (the wrapper's ``close()``).

Checkpoints: :meth:`~AsyncModelAverageAlgorithm.state_dict` waits for a round in flight to
finish, then holds the pending correction (per parameter name, not yet added to the
weights: save it together with the model's ``state_dict``, in either order), the round
counter, whether averaging was aborted, and ``interval_ms``. Loading (collective: every rank
loads its own checkpoint) stops the thread, drops the correction accumulated since wrapping,
restores the saved one and restarts the thread unless the checkpoint was taken while
aborted. With rounds running in the background, when they happen depends on timing, so a
resumed run is not bit-identical to an uninterrupted one, and ranks that save at different
moments may each hold a different number of rounds. For an exact, consistent checkpoint
pause averaging first: call ``abort()`` (collective) before saving, optionally run
synchronous rounds with :meth:`~AsyncModelAverageAlgorithm.average_now`; a run resumed from
such a checkpoint, fed the same data, then reproduces the original bit for bit (tested).

Example:
    >>> AsyncConfig(interval_ms=20).interval_ms
    20
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.algorithms.finite import non_finite
from hexagram.algorithms.weight_sync import (
    average_weights,
    flats_from_named,
    named_from_flats,
    sync_buffers,
)
from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator
from hexagram.comm.control import count_flags
from hexagram.comm.device import start_thread
from hexagram.comm.streams import consume, mark, on_stream, side_stream
from hexagram.config import check_float
from hexagram.errors import CommError, ConfigError, NonFiniteGradientError

__all__ = ["AsyncConfig", "AsyncModelAverageAlgorithm"]


@dataclass(frozen=True, kw_only=True)
class AsyncConfig:
    """Config of :class:`AsyncModelAverageAlgorithm`.

    Attributes:
        interval_ms: start an averaging round at most every ``interval_ms`` milliseconds;
            smaller => replicas stay closer, more traffic and more CPU for the thread.
    """

    interval_ms: float = 50.0

    def __post_init__(self) -> None:
        check_float(self, "interval_ms", low=0.0)


def _snapshot(tensors: list[Tensor]) -> Tensor:
    """The current values of ``tensors`` (one dtype) as a new flat tensor."""
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1) for t in tensors])


def _float_buffers(module: torch.nn.Module) -> list[list[Tensor]]:
    """Floating buffers (BatchNorm statistics), grouped by dtype and device."""
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for b in module.buffers():
        if b.is_floating_point():
            groups.setdefault((b.dtype, b.device), []).append(b)
    return list(groups.values())


class AsyncModelAverageAlgorithm(Algorithm):
    """Background weight averaging on a separate process group; see the module docstring."""

    name = "async"
    kind = "weight"
    exchange_overlap = "background"  # a thread averages while training runs

    def __init__(self, config: AsyncConfig | None = None) -> None:
        super().__init__(config or AsyncConfig())
        self.config: AsyncConfig
        self.rounds = 0
        self._lock = threading.Lock()  # guards _pending
        self._round_lock = threading.Lock()  # held for a whole round (state_dict waits on it)
        self._pending: list[Tensor] | None = None
        self._stop = threading.Event()
        self._active = True
        self._aborted = False
        self._paused = False  # abort() called (and no resume() since): saved in checkpoints
        self._closed = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        #: NaN/Inf found in the last round's means (device flag), sent with the next control
        self._bad: Tensor | bool = False

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        group = ctx.runtime.new_group("async_model_average")  # collective, same order
        self.comm = Communicator(group, ctx.runtime.timeout, name="async", owns_group=True)
        self._device = ctx.runtime.device
        self._ready: torch.cuda.Event | None = None  # when _pending was computed (CUDA)
        # averaged like the weights, as corrections (BatchNorm running statistics)
        self._buffers = _float_buffers(ctx.module)
        self._start()

    def _groups(self) -> list[list[Tensor]]:
        """What a round averages: each bucket's parameters, then each buffer group."""
        params: list[list[Tensor]] = [[e.param for e in b.entries] for b in self.ctx.buckets]
        return params + self._buffers

    # -- background thread ---------------------------------------------------------------
    def _start(self) -> None:
        if self.comm.size == 1:
            return
        self._stop.clear()
        self._active, self._aborted = True, False
        # the thread sets the rank's CUDA device before anything (it is per thread)
        self._thread = start_thread(self._loop, name="hexagram-async-average",
                                    device=self._device)

    def _loop(self) -> None:
        try:
            period = self.config.interval_ms / 1000.0
            next_round = time.monotonic()
            stream = side_stream(self._device)  # rounds overlap the training stream
            while True:
                self._stop.wait(max(0.0, next_round - time.monotonic()))
                next_round = time.monotonic() + period
                with self._round_lock:
                    # after the training stream's work so far (the snapshot reads weights)
                    if not on_stream(stream, self._one_round)():
                        return
        except BaseException as exc:
            self._error = exc

    def _one_round(self) -> bool:
        """One collective round; False when every thread must stop (same on all ranks)."""
        received, self._bad = self._bad, False
        counts = count_flags(self.comm, active=self._active, stop=self._stop.is_set(),
                             nonfinite=received).wait()
        if counts.nonfinite > 0:  # the same count on every rank: every thread stops here
            self._aborted = True
            self._error = NonFiniteGradientError(
                f"async: the average of the weights received at round {self.rounds} held "
                f"NaN or Inf on {counts.nonfinite} rank(s) (a rank sent NaN/Inf weights; "
                "the sender cannot be known from a sum); it was not applied. Lower the "
                "learning rate, clip gradients or use loss scaling; if one rank is faulty "
                "or hostile, check its host and network")
            return False
        if counts.stop > 0:
            self._aborted = True  # a peer (or I) asked to stop: everyone stops here
            return False
        if counts.active == 0:
            return False
        self._average()
        return True

    def _average(self) -> None:
        """Steps 2-4 of a round (collective on the async communicator)."""
        with self._lock:
            pending = self._pending
            snaps = [_snapshot(g) for g in self._groups()]
            if pending is not None:
                consume(self._ready, pending)
                snaps = [s + p for s, p in zip(snaps, pending)]
        handles = [primitives.allreduce(self.comm, s.clone(), average=True) for s in snaps]
        means = [h.wait() for h in handles]
        # NaN/Inf in a mean never reaches the weights: its round's correction is dropped
        # (device-side, no read) and the flag rides in the next round's control collective
        bad = torch.stack([non_finite(m) for m in means]).any()
        deltas = [(m - s).masked_fill_(bad, 0.0) for m, s in zip(means, snaps)]
        self._bad = bad
        with self._lock:
            if self._pending is None:
                self._pending = deltas
            else:
                consume(self._ready, self._pending)  # made by an earlier round's stream
                self._pending = [p + d for p, d in zip(self._pending, deltas)]
            self._ready = mark(self._device)  # the training thread waits for this
        self.rounds += 1

    # -- training thread -------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, NonFiniteGradientError):  # found alike by every rank
                raise error
            raise CommError(f"async model averaging thread failed: {error}") from error

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
            ready, self._ready = self._ready, None
        if pending is not None:
            consume(ready, pending)  # this stream waits for the round's, no host block
            with torch.no_grad():
                for group, delta in zip(self._groups(), pending):
                    for t, d in zip(group, delta.split([t.numel() for t in group])):
                        t.add_(d.view_as(t))

    def _join_thread(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self._apply_pending()
        self._raise_if_failed()

    def before_forward(self) -> None:
        self._raise_if_failed()
        self._apply_pending()

    def abort(self) -> None:
        """Stop background averaging after the current round (collective)."""
        self._stop.set()
        self._join_thread()
        self._aborted = self._paused = True

    def resume(self) -> None:
        """Restart background averaging after :meth:`abort` (collective)."""
        if self._closed:
            raise RuntimeError("async: resume() after close(); wrap the model again")
        self._paused = False
        if self._thread is None:
            self._start()

    def synchronize(self) -> None:
        """Average until every rank is inactive, then make all weights identical."""
        self._active = False
        self._join_thread()
        average_weights(self.ctx.comm, self.ctx.buckets)
        sync_buffers(self.ctx.comm, self.ctx.module)
        if not self._aborted and not self._closed:
            self._start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        try:
            self._join_thread()
        finally:
            self.comm.close()

    def bytes_sent(self) -> int:
        return self.ctx.comm.counter.total + self.comm.counter.total

    def average_now(self) -> None:
        """One averaging round on the calling thread (collective), while :meth:`abort` has
        paused the background thread. Its correction is added at the next forward pass, as
        a background round's would be: deterministic rounds for tests and exact resumes."""
        if self._thread is not None:
            raise RuntimeError("async: average_now() needs the background thread stopped; "
                               "call abort() first")
        self._raise_if_failed()
        if self.comm.size > 1:
            self._average()

    def state_dict(self) -> dict[str, Any]:
        """Pending correction, counters and settings; see "Checkpoints" in the module doc."""
        with self._round_lock, self._lock:  # no half-applied round in the checkpoint
            consume(self._ready, self._pending)  # read on this thread's stream
            pending = None if self._pending is None else \
                named_from_flats(self.ctx.buckets, self._pending)
            extra = [] if self._pending is None else \
                [t.clone() for t in self._pending[len(self.ctx.buckets):]]
            return {"rounds": self.rounds, "pending": pending, "pending_buffers": extra,
                    "aborted": self._paused,
                    "interval_ms": self.config.interval_ms}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (collective when the thread runs or restarts)."""
        if float(state["interval_ms"]) != self.config.interval_ms:
            raise ConfigError(f"async: checkpoint was saved with interval_ms="
                              f"{state['interval_ms']}, this algorithm has "
                              f"{self.config.interval_ms}; use the same AsyncConfig")
        pending = None if state["pending"] is None else \
            flats_from_named(self.ctx.buckets, state["pending"], "async pending correction") \
            + list(state.get("pending_buffers", []))
        self._halt()
        with self._lock:
            self._pending, self._ready = pending, None
        self._bad = False  # a flag of the replaced state's rounds
        self.rounds = int(state["rounds"])
        self._aborted = self._paused = bool(state["aborted"])
        if not self._aborted and not self._closed:
            self._start()

    def _halt(self) -> None:
        """Stop the thread (collective) and drop its pending correction unapplied."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        with self._lock:
            self._pending, self._ready = None, None
        self._raise_if_failed()
