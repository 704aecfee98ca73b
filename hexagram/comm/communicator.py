"""A process group with one issuing thread, handles with timeouts, and byte accounting.

Why one thread: collectives on a process group must be issued in the same order on every
rank. Multi-stage operations (scatter-gather: all-to-all, reduce, allgather) need the result
of one stage before issuing the next, so they cannot all be issued from the autograd hook.
Every operation of a :class:`Communicator` is therefore a job run, in submission order, by a
single worker thread; single-stage jobs return the torch ``Work`` without waiting, so several
collectives are in flight at once exactly as with PyTorch DDP.

Example:
    >>> comm = Communicator(group=None, timeout=timedelta(seconds=60), name="grads")
    ... # doctest: +SKIP
    >>> handle = comm.submit("allreduce", lambda: Deferred(dist.all_reduce(t, async_op=True),
    ...                      lambda: t), nbytes_sent=comm.ring_allreduce_bytes(t))  # +SKIP
    >>> handle.wait()  # doctest: +SKIP

Abort: :meth:`Communicator.abort` (or :func:`~hexagram.comm.abort.abort_all` for every
live communicator of the process) marks a communicator failed and wakes every thread
blocked in :meth:`Handle.wait` with a :class:`CommError` at once, abandoning the work in
flight. Live elastic training calls it when a peer died, because gloo's asynchronous work
is not woken by ``ProcessGroup.abort()`` and would otherwise wait out the collective
timeout (:mod:`hexagram.comm.abort` holds the helpers).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch.distributed as dist
from torch import Tensor

from hexagram.comm.abort import abort_all, completed, done_signal, hold, register
from hexagram.comm.device import device_initializer, group_device
from hexagram.comm.streams import StreamJob, join_stream, on_stream, side_stream
from hexagram.errors import CommError, CommTimeoutError

__all__ = ["ByteCounter", "Communicator", "Deferred", "Handle", "abort_all"]

T = TypeVar("T")
U = TypeVar("U")


@dataclass
class Deferred:
    """A job's result that is still in flight: wait on ``work``, then call ``finish``."""

    work: Any  # torch.distributed.Work
    finish: Callable[[], Any]


class ByteCounter:
    """Thread-safe count of the bytes this rank sends, per operation name.

    Counts follow the algorithm the collective uses (ring allreduce sends
    ``2 (P-1)/P * n`` bytes; an allgather of ``n`` bytes per rank sends ``(P-1) n``), so they
    can be checked against interface counters on a real link.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_op: dict[str, int] = defaultdict(int)
        self._total = 0

    def add(self, op: str, nbytes: int) -> None:
        with self._lock:
            self._by_op[op] += int(nbytes)
            self._total += int(nbytes)

    @property
    def total(self) -> int:
        """Bytes sent since creation."""
        with self._lock:
            return self._total

    def by_op(self) -> dict[str, int]:
        """Bytes sent per operation name since creation."""
        with self._lock:
            return dict(self._by_op)


class Handle(Generic[T]):
    """Result of an asynchronous operation; :meth:`wait` returns it or raises CommError."""

    def __init__(self, future: cf.Future[Any] | None, op: str, comm: Communicator | None,
                 value: Any = None) -> None:
        self._future = future
        self._op = op
        self._comm = comm
        self._value = value
        self._resolved = future is None
        self.stream_job: StreamJob | None = None  # set by Communicator.submit on CUDA
        # derived handles (then / gather): the handles they wait on, and how to combine
        self._then: tuple[list[Handle[Any]], Callable[[list[Any]], Any]] | None = None

    @classmethod
    def completed(cls, value: T, op: str = "noop") -> Handle[T]:
        """A handle that is already done (world size 1, nothing to communicate)."""
        return cls(None, op, None, value=value)

    def done(self) -> bool:
        """True when :meth:`wait` would not block on the worker."""
        if self._then is not None:
            return self._resolved or all(h.done() for h in self._then[0])
        return self._resolved or (self._future is not None and self._future.done())

    def then(self, fn: Callable[[T], U]) -> Handle[U]:
        """A handle whose result is ``fn(self.wait())``, computed once, on the first wait
        (in the waiting thread, so ``fn`` may do tensor work without blocking the issuer)."""
        return Handle._derived([self], lambda results: fn(results[0]), self._op)

    def then_wait(self, fn: Callable[[T], Handle[U]]) -> Handle[U]:
        """A handle whose result is that of the handle ``fn(self.wait())`` starts: the next
        stage of a multi-stage operation (PowerSGD: allreduce P, orthogonalize, allreduce
        Q), chained as PyTorch chains ``Future.then``. ``fn`` runs on the first wait, in the
        waiting thread, so the issuing thread never blocks on the stage's compute and
        operations submitted after this one (later buckets) are not queued behind it; the
        engine waits handles in bucket order, so every rank issues the next stage's
        collectives in the same order."""
        return Handle._derived([self], lambda results: fn(results[0]).wait(), self._op)

    @classmethod
    def gather(cls, handles: Sequence[Handle[Any]], op: str = "gather") -> Handle[list[Any]]:
        """One handle over several: its result is the list of their results, in order."""
        return Handle._derived(list(handles), list, op)

    @staticmethod
    def _derived(inners: list[Handle[Any]], fn: Callable[[list[Any]], Any],
                 op: str) -> Handle[Any]:
        derived: Handle[Any] = Handle(None, op, None)
        derived._resolved, derived._then = False, (inners, fn)
        return derived

    def wait(self) -> T:
        """Block until done; raise :class:`CommTimeoutError` / :class:`CommError` on failure."""
        if self._resolved:
            return self._value  # type: ignore[no-any-return]
        if self._then is not None:
            inners, fn = self._then
            self._value, self._resolved = fn([h.wait() for h in inners]), True
            return self._value  # type: ignore[no-any-return]
        assert self._future is not None and self._comm is not None
        comm = self._comm
        try:
            result = comm.await_future(self._future, comm.timeout.total_seconds() + 5.0)
            join_stream(self.stream_job, None)  # the waiter's stream waits; no host block
            if isinstance(result, Deferred):
                comm.await_work(result.work)
                result = result.finish()
        except BaseException as exc:  # re-raised with context
            raise comm.wrap_error(self._op, exc) from exc
        join_stream(self.stream_job, result)  # memory of the result: used on this stream
        self._value, self._resolved = result, True
        return result  # type: ignore[no-any-return]


class Communicator:
    """A torch.distributed process group plus its issuing thread and byte counter.

    Args:
        group: the process group (``None``: the default group).
        timeout: how long any operation may take before :class:`CommTimeoutError`.
        name: shown in thread names and error messages (e.g. ``"grads"``, ``"async"``).
        owns_group: the group was made for this communicator (a wrapper's, an ``auto``
            switch's): :meth:`close` destroys it when it is an NCCL group, whose
            communicators hold GPU memory and a watchdog thread until destroyed. gloo
            groups are left to garbage collection (destroying one joins its worker threads,
            which at interpreter exit can deadlock on the GIL).

    Dead peers: gloo work is waited with this communicator's ``timeout`` on the host. NCCL
    work is waited as PyTorch DDP waits it: ``work.wait()`` without a timeout makes the
    current CUDA stream wait for the collective and returns at once (a timeout argument
    would block the host until the GPU finishes); the dead-peer timeout is then the
    process group's own (``timeout`` given to ``new_group``), enforced by NCCL's watchdog
    thread off the hot path, which aborts the communicator and raises in the training
    thread (``TORCH_NCCL_ASYNC_ERROR_HANDLING``).
    """

    def __init__(self, group: dist.ProcessGroup | None, timeout: timedelta, name: str,
                 owns_group: bool = False) -> None:
        self.group = group
        self.timeout = timeout
        self.name = name
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.global_ranks: list[int] = (
            dist.get_process_group_ranks(group) if group is not None
            else list(range(self.size))
        )
        self.counter = ByteCounter()
        self.device = group_device(group)
        # CUDA: every job runs on this stream, ordered by events (see comm/streams.py)
        self.stream = side_stream(self.device)
        # the issuing thread sets its CUDA device first (the current device is per thread)
        self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix=f"hexagram-comm-{name}",
                                               initializer=device_initializer(self.device))
        self._broken: BaseException | None = None
        self._lock = threading.Lock()
        self._queued = 0  # jobs handed to the issuing thread and not finished
        # abort: resolved by abort(); waits race their work against it. NCCL work waits
        # on the stream, not the host, so it keeps torch's own wait (ncclCommAbort wakes it).
        self._aborted: cf.Future[None] = cf.Future()
        self._pg = group if group is not None else dist.group.WORLD
        self._nccl = dist.get_backend(group) == "nccl"
        self._abortable = not self._nccl
        self._owns_group = owns_group
        register(self)

    def submit(self, op: str, job: Callable[[], Any], nbytes_sent: int = 0,
               inline: bool = False) -> Handle[Any]:
        """Run ``job`` on the issuing thread; count ``nbytes_sent`` for this rank.

        ``inline=True`` (for jobs that only *issue* one collective and return its
        :class:`Deferred`) runs ``job`` in the calling thread when the issuing thread has
        nothing queued or running, so the collective starts without a thread hand-over
        (on busy cores that hand-over waits for the scheduler); the issue order is the
        submission order either way.
        """
        if self._broken is not None:
            raise CommError(
                f"{op}: communicator '{self.name}' is unusable after an earlier failure "
                f"({self._broken}); restart the job"
            )
        self.counter.add(op, nbytes_sent)
        staged = on_stream(self.stream, job)  # after the caller's stream, on this one's
        with self._lock:
            if inline and self._queued == 0:
                future: cf.Future[Any] = cf.Future()
                try:
                    future.set_result(staged())
                except BaseException as exc:  # re-raised, wrapped, by Handle.wait
                    future.set_exception(exc)
                return self._handle(future, op, staged)
            self._queued += 1
        return self._handle(self._executor.submit(self._run, staged), op, staged)

    def _handle(self, future: cf.Future[Any], op: str, staged: StreamJob) -> Handle[Any]:
        handle: Handle[Any] = Handle(future, op, self)
        handle.stream_job = staged if self.stream is not None else None
        return handle

    def _run(self, job: Callable[[], Any]) -> Any:
        try:
            return job()
        finally:
            with self._lock:
                self._queued -= 1

    def global_rank(self, group_rank: int) -> int:
        """Global rank of the member with index ``group_rank`` in this group."""
        return self.global_ranks[group_rank]

    def wrap_error(self, op: str, exc: BaseException) -> CommError:
        """Turn a backend failure into an error that names the operation and what to do."""
        if isinstance(exc, CommError):
            return exc
        text = str(exc)
        where = f"{op} on rank {self.rank} of {self.size} (communicator '{self.name}')"
        if isinstance(exc, (cf.TimeoutError, TimeoutError)) or "imed out" in text:
            err: CommError = CommTimeoutError(
                f"{where} timed out after {self.timeout.total_seconds():.0f}s: a peer stopped "
                f"answering. Check the other ranks; raise hexagram.init(timeout=...) if the "
                f"step is legitimately slower. Backend said: {text}"
            )
        else:
            err = CommError(
                f"{where} failed: a peer probably died or closed its connection. "
                f"Check the other ranks' logs. Backend said: {text}"
            )
        self._broken = err
        return err

    def close(self) -> None:
        """Stop the issuing thread (waits for queued jobs, unless aborted); destroy the
        group if this communicator owns it and it is NCCL (see the class docstring)."""
        self._executor.shutdown(wait=not self._aborted.done())
        if self._owns_group and self._nccl and self.group is not None \
                and not self._aborted.done():
            # self.group stays set: a later collective fails on the destroyed group
            # instead of silently running on the default one (group=None)
            self._owns_group, self._pg = False, None
            with contextlib.suppress(RuntimeError, ValueError):  # already destroyed
                dist.destroy_process_group(self.group)

    # -- abort ---------------------------------------------------------------------------
    @property
    def aborted(self) -> bool:
        """True once :meth:`abort` ran."""
        return self._aborted.done()

    def abort(self, reason: str = "aborted") -> None:
        """Fail this communicator now: every pending and future :meth:`Handle.wait` raises
        :class:`CommError` naming ``reason`` at once, and :meth:`submit` refuses new work.

        The work in flight is abandoned, not completed: the process group is aborted
        (``ProcessGroup.abort()``) and kept referenced until its own timeout has surely
        ended that work (destroying a gloo group joins its threads, which would block on
        the stuck collective). Idempotent; safe from any thread. A communicator is not
        usable after this: build a new group (live elastic mode does).

        Example:
            >>> comm.abort("peer 2 died")     # doctest: +SKIP
            >>> handle.wait()                 # doctest: +SKIP
            Traceback (most recent call last):
            hexagram.errors.CommError: ... was aborted: peer 2 died
        """
        with self._lock:
            if self._aborted.done():
                return
            if self._broken is None:
                self._broken = CommError(f"communicator '{self.name}' was aborted: {reason}")
            self._aborted.set_result(None)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._pg is not None:
            try:
                self._pg.abort()
            except (AttributeError, RuntimeError):  # a backend without abort: timeout ends it
                pass
            hold(self._pg, self.timeout.total_seconds() + 5.0)

    def _raise_if_aborted(self) -> None:
        if self._aborted.done():
            raise CommError(str(self._broken))

    def await_future(self, future: cf.Future[Any], timeout: float) -> Any:
        """``future.result()``, but raise at once when aborted and ``cf.TimeoutError``
        after ``timeout`` s."""
        if not future.done():
            cf.wait([future, self._aborted], timeout, cf.FIRST_COMPLETED)
            if not future.done():
                self._raise_if_aborted()
                raise cf.TimeoutError(f"no result within {timeout:.0f}s")
        return future.result()

    def await_work(self, work: Any) -> None:
        """``work.wait(timeout)`` (a torch ``Work``, or an object with ``works``), woken by
        :meth:`abort`. Works without a future (gloo's point-to-point sends and receives)
        wait as torch waits: they end with the backend's timeout or connection error.
        NCCL work: ``work.wait()``, a stream wait that does not block the host (see the
        class docstring for its timeout)."""
        self._raise_if_aborted()
        if self._nccl:
            work.wait()
            return
        if self._abortable and not completed(work):
            signal = done_signal(work)
            if signal is not None:
                self.await_future(signal, self.timeout.total_seconds())
        work.wait(self.timeout)

    # -- byte formulas (what this rank sends), shared by the primitives -----------------
    def ring_allreduce_bytes(self, t: Tensor) -> int:
        """Ring allreduce: reduce-scatter then allgather, each (P-1)/P of the tensor."""
        n = t.numel() * t.element_size()
        return 2 * (self.size - 1) * n // self.size if self.size > 1 else 0

    def allgather_bytes(self, nbytes_per_rank: int) -> int:
        """Ring allgather: this rank's block is forwarded P-1 times around the ring."""
        return (self.size - 1) * nbytes_per_rank

    def alltoall_bytes(self, nbytes_total: int) -> int:
        """All-to-all of a buffer split into P chunks: P-1 chunks leave this rank."""
        return (self.size - 1) * nbytes_total // self.size if self.size > 1 else 0
