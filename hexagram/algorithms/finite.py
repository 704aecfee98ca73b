"""Non-finite gradients found on the device, read once per step.

Reading a tensor (``bool(t)``, ``.item()``) on a GPU waits for every kernel queued before it;
one such read per bucket would stop communication overlapping backward. So the gradient
algorithms only *queue* their checks: per bucket a 0-d bool tensor that is True when
something went wrong (NaN/Inf in the bucket before or after reduction, a value past fp16's
range), with a function that explains it. :meth:`StepChecks.read` reads them all at once
at the end of backward, in one host read, and returns the first explanation (which may read
freely: it runs only when a check failed). One :class:`StepChecks` lives on the
:class:`~hexagram.algorithms.base.AlgorithmContext`, shared by an algorithm and its wrappers.

Example:
    >>> import torch
    >>> checks = StepChecks()
    >>> checks.add(torch.isinf(torch.tensor(1.0)), lambda: "never")
    >>> checks.add(torch.isnan(torch.tensor(float("nan"))), lambda: "a NaN")
    >>> checks.read()
    'a NaN'
    >>> checks.read() is None  # read once: the queue is empty again
    True
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from hexagram.buckets import Bucket

__all__ = ["StepChecks", "non_finite", "output_problem"]


class StepChecks:
    """Device-side conditions queued during a step (see the module docstring).

    Thread-safe: buckets finish on the waiting thread or the communicator's.
    """

    def __init__(self) -> None:
        self._items: list[tuple[Tensor, Callable[[], str]]] = []
        self._lock = threading.Lock()
        #: True when the engine reads the queue at the optimizer step together with its
        #: own non-finite check (one host read per step for both): :meth:`due` then reads
        #: nothing at the end of backward
        self.deferred = False

    def add(self, bad: Tensor, explain: Callable[[], str]) -> None:
        """Queue ``bad`` (a 0-d bool tensor, any device; True: a problem) and the function
        that describes the problem (called only if ``bad`` is True)."""
        with self._lock:
            self._items.append((bad, explain))

    def read(self, also: Tensor | None = None) -> str | None:
        """None if no queued condition holds, else the first one's explanation; empties
        the queue. One host read whatever the number of conditions (none if none).
        ``also`` (a 0-d bool tensor) joins that one read: if only it holds, the result is
        ``""`` (the caller explains it)."""
        items = self.take()
        if also is not None:
            items.append((also, lambda: ""))
        if not items:
            return None
        flags = torch.stack([bad.reshape(()).to(items[0][0].device) for bad, _ in items])
        if not bool(flags.any()):  # the step's one host read
            return None
        for bad, explain in items:  # a failure: reading more costs nothing that matters
            if bool(bad):
                return explain()
        return None  # pragma: no cover - flags.any() held

    def due(self) -> str | None:
        """:meth:`read` at the end of backward, unless the engine reads at the optimizer
        step (``deferred``): then None, and the queue waits for the engine."""
        return None if self.deferred else self.read()

    def take(self) -> list[tuple[Tensor, Callable[[], str]]]:
        """The queued conditions, emptying the queue (no read)."""
        with self._lock:
            items, self._items = self._items, []
        return items

    def clear(self) -> None:
        """Drop queued conditions (a step abandoned before its end)."""
        with self._lock:
            self._items = []


def non_finite(flat: Tensor) -> Tensor:
    """0-d bool: ``flat`` holds NaN or Inf. Its minimum and maximum (one read-only pass,
    nothing allocated) are finite exactly when every value is; unlike a sum they cannot
    overflow, so no exact second pass is needed."""
    return ~torch.isfinite(torch.stack(torch.aminmax(flat))).all()


def output_problem(bucket: Bucket, result: Tensor, step: int, who: str,
                   names: Sequence[str] | None = None) -> str:
    """The message for a bucket that held NaN/Inf at ``step``: the first parameter whose
    reduced gradient (``result``, the bucket's flat layout) holds some, with their counts;
    else (the compressor's output hid them: a sign, an unsampled entry) the bucket's
    parameters. Runs only on a failure (it reads the device freely)."""
    flat = result.reshape(-1)
    for e in bucket.entries:
        t = flat[e.offset:e.offset + e.numel]
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if nan or inf:
            return (f"{who}: gradient of parameter '{e.name}' at step {step} holds {nan} NaN "
                    f"and {inf} Inf of {e.numel} values after reduction (a rank's gradient "
                    "held NaN or Inf). Lower the learning rate, clip gradients or use loss "
                    "scaling; or pass on_nonfinite='skip' to skip such steps")
    listed = ", ".join(f"'{n}'" for n in (names or bucket.names))
    return (f"{who}: the gradient of one of the parameters {listed} held NaN or Inf at step "
            f"{step} before compression (its compressed form does not show them). Lower the "
            "learning rate, clip gradients or use loss scaling; or pass on_nonfinite='skip'")
