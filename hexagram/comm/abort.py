"""Abandoning communication in flight: waking waits at once, aborting every communicator.

gloo's asynchronous work is not woken by ``ProcessGroup.abort()``: a thread waiting on it
would wait out the collective timeout after a peer died. A
:class:`~hexagram.comm.communicator.Communicator` therefore waits on a work's torch future
(:func:`done_signal`) raced against its own abort; :func:`abort_all` aborts every live
communicator of the process (live elastic mode calls it when a peer died); an aborted
process group is kept referenced off the hot path (:func:`hold`) until its own timeout has
ended the work stuck in it, since destroying a gloo group joins those threads.

Example:
    >>> abort_all("peer 2 died")   # every live communicator: waits raise CommError now
    ... # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import weakref
from typing import Any, Protocol

__all__ = ["Abortable", "abort_all", "completed", "done_signal", "hold", "register"]


class Abortable(Protocol):
    """What :func:`abort_all` needs of a communicator."""

    @property
    def aborted(self) -> bool: ...

    def abort(self, reason: str = "aborted") -> None: ...


# -- every live communicator of the process, for abort_all ---------------------------------
_REGISTRY: weakref.WeakSet[Any] = weakref.WeakSet()
_REGISTRY_LOCK = threading.Lock()


def register(comm: Abortable) -> None:
    """Make ``comm`` one of those :func:`abort_all` aborts (held weakly)."""
    with _REGISTRY_LOCK:
        _REGISTRY.add(comm)


def abort_all(reason: str = "aborted") -> int:
    """``abort(reason)`` every communicator of this process not yet aborted;
    returns how many were aborted (live elastic mode calls it when a peer died)."""
    with _REGISTRY_LOCK:
        comms: list[Abortable] = [c for c in _REGISTRY if not c.aborted]
    for comm in comms:
        comm.abort(reason)
    return len(comms)


def completed(work: Any) -> bool:
    """True when ``work`` (or every one of ``work.works``) reports it completed."""
    works = getattr(work, "works", None)
    if works is not None:
        return all(completed(w) for w in works)
    is_completed = getattr(work, "is_completed", None)
    return bool(is_completed()) if is_completed is not None else False


def done_signal(work: Any) -> cf.Future[None] | None:
    """A future resolved when ``work`` (or all of ``work.works``) finished, with or
    without an error; None when a work has no torch future to follow."""
    works = list(getattr(work, "works", [work]))
    try:
        futures = [w.get_future() for w in works]
    except (AttributeError, RuntimeError):  # "Work::getFuture not implemented" (p2p)
        return None
    signal: cf.Future[None] = cf.Future()
    left, lock = [len(futures)], threading.Lock()

    def one_done(_: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            signal.set_result(None)

    if not futures:
        signal.set_result(None)
    for fut in futures:
        fut.add_done_callback(one_done)
    return signal


def hold(obj: Any, seconds: float) -> None:
    """Keep ``obj`` referenced for ``seconds`` from a daemon thread (its destructor then runs
    there; at interpreter exit the thread is frozen and the destructor never blocks)."""
    threading.Thread(target=_keep, args=(obj, seconds), daemon=True,
                     name="hexagram-comm-aborted").start()


def _keep(obj: Any, seconds: float) -> None:
    del obj  # the thread's arguments hold it until the sleep ends
    time.sleep(seconds)
