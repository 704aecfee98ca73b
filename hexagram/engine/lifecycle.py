"""A wrapper's resources, released once: by ``close()``, garbage collection or interpreter exit.

PyTorch DDP needs no ``close()``; a drop-in must not either. What a wrapper owns outside
Python's reference counting (background threads that take part in collectives, the issuing
thread of its communicator, autograd and optimizer hooks) lives in one :class:`Resources`
object, and :func:`attach` ties its release to the wrapper's life with
:func:`weakref.finalize`:

- ``close()`` releases them now, raising what goes wrong;
- the wrapper being garbage-collected, or the interpreter exiting with the wrapper still
  alive (a script that ends without ``close()``), releases them quietly: a failure is
  written to stderr, never raised, so a normal end exits with code 0 on every rank.

Why at exit: a daemon thread still inside a C++ collective when the interpreter finalises
is killed by ``pthread_exit``, whose unwinding through ``noexcept`` frames ends the process
with ``terminate called without an active exception`` (SIGABRT). Stopping the threads
first (each algorithm's ``close()``) avoids that.

Example:
    >>> res = Resources(algorithm=None, comm=None)
    >>> res.release()   # nothing to release
    >>> res.released
    True
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hexagram.algorithms.base import Algorithm
from hexagram.comm.communicator import Communicator
from hexagram.runtime import settle_collective_workers

__all__ = ["Resources", "attach", "weak_method"]


@dataclass
class Resources:
    """What a wrapper must release; the wrapper updates ``reducer`` when it rebuilds.

    Attributes:
        algorithm: its ``close()`` stops background threads and finishes exchanges in flight.
        comm: the wrapper's communicator (its issuing thread is stopped last).
        reducer: the current gradient reducer (its autograd hooks are removed and its
            buckets, handles and guard let go), or None.
        hooks: other hook handles (optimizer step hooks) to remove.
    """

    algorithm: Algorithm | None
    comm: Communicator | None
    reducer: Any = None
    hooks: list[Any] = field(default_factory=list)
    released: bool = False

    def release(self) -> None:
        """Stop and detach everything, once; later calls do nothing."""
        if self.released:
            return
        self.released = True
        try:
            if self.algorithm is not None and self.algorithm.is_set_up:  # else nothing to stop
                self.algorithm.close()
        finally:
            if self.reducer is not None:  # hooks, buckets, handles, guard
                self.reducer.release()
                self.reducer = None
            for handle in self.hooks:
                handle.remove()
            self.hooks = []
            if self.comm is not None:
                self.comm.close()

    def release_quietly(self) -> None:
        """:meth:`release` for garbage collection and interpreter exit: report, never raise."""
        try:
            self.release()
        except BaseException as exc:  # nothing can handle it at exit
            name = getattr(self.algorithm, "name", "?")
            print(f"hexagram: releasing algorithm {name!r} at exit failed: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
        if self.comm is not None:  # garbage collection or exit: finalisation may be next
            _let_collective_workers_finish()


def _let_collective_workers_finish() -> None:
    """Release the GIL for a moment after the last collectives of a wrapper released by
    garbage collection or at exit (:func:`hexagram.runtime.settle_collective_workers`:
    why); ``close()`` does not pause."""
    settle_collective_workers()


def attach(owner: object, resources: Resources) -> weakref.finalize:
    """Release ``resources`` when ``owner`` is collected or at interpreter exit.

    ``resources`` must not refer to ``owner`` (or it would never be collected). Returns the
    finalizer: call it to release now (it runs once), as ``close()`` does.
    """
    finalizer = weakref.finalize(owner, resources.release_quietly)
    finalizer.atexit = True
    return finalizer


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """A callable that forwards to ``method`` while its object lives, else does nothing.

    For hooks registered on long-lived objects (an optimizer's step hooks), so that they do
    not keep the wrapper alive.
    """
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        return None if target is None else target(*args, **kwargs)

    return call
