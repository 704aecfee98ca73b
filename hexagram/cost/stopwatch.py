"""The one stopwatch: how every measurement of the cost model and of the planner's
calibration times a function.

- :func:`best_time`: one process, the least (or the median) of a few runs after a warm-up;
- :func:`interleaved`: several functions in turns, each call started at a barrier of a
  process group, so load that drifts over the turns hits every function alike and
  per-turn differences are what the functions themselves cost;
- :func:`synchronous_times`: what a collective step lasts, the slowest rank per call (a
  step waits for the last rank), the median over turns.

Example:
    >>> best_time(lambda: sum(range(100)), repeat=3) >= 0.0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["best_time", "default_device", "fastest", "interleaved", "median_time",
           "synchronous_time", "synchronous_times"]

T = TypeVar("T")


def fastest(fn: Callable[[], T], repeat: int, clock: Callable[[], float] = time.perf_counter
            ) -> tuple[float, T]:
    """(least seconds of ``repeat`` runs of ``fn`` on ``clock``, the last run's result), no
    warm-up: a CPU clock (``time.thread_time``) for the CPU seconds a rank spends on work
    that competes with its compute.

    >>> fastest(lambda: 3, 2, time.thread_time)[1]
    3
    """
    if repeat < 1:
        raise ValueError(f"fastest: repeat must be >= 1, got {repeat}")
    start = clock()
    out = fn()
    best = clock() - start
    for _ in range(repeat - 1):
        start = clock()
        out = fn()
        best = min(best, clock() - start)
    return best, out


def best_time(fn: Callable[[], object], repeat: int, stat: str = "min") -> float:
    """Seconds of ``fn()`` after one warm-up call: the least (``stat="min"``) or the median
    (``"median"``: what a training step sees on a shared machine) of ``repeat`` runs."""
    if stat not in ("min", "median"):
        raise ValueError(f"best_time: stat must be 'min' or 'median', got {stat!r}")
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) if stat == "min" else statistics.median(times)


def median_time(fn: Callable[[], object], repeat: int) -> float:
    """This rank's median seconds of ``fn`` over ``repeat`` calls, after a barrier
    (collective: every rank starts together)."""
    import torch.distributed as dist

    dist.barrier()
    return best_time(fn, repeat, "median")


def default_device() -> torch.device:
    """Where measured work runs: the runtime's device when hexagram is initialised, else
    CUDA if present, else CPU."""
    from hexagram.runtime import get_runtime, is_initialized

    if is_initialized():
        return get_runtime().device
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def interleaved(fns: list[Callable[[], object]], repeat: int, group: object = None
                ) -> list[list[float]]:
    """Seconds of each of ``fns``, run in turn ``repeat`` times (after one warm-up turn),
    each call between barriers of ``group`` (collective): ``out[k][r]`` is ``fns[k]`` in
    turn ``r``. Load that drifts over the turns hits every function alike, so per-turn
    differences (and their median) are what the functions themselves cost.

    Example:
        >>> a, b = interleaved([plain, sharded], 9)               # doctest: +SKIP
        >>> statistics.median(y - x for x, y in zip(a, b))        # doctest: +SKIP
    """
    import torch.distributed as dist

    out: list[list[float]] = [[] for _ in fns]
    for turn in range(repeat + 1):
        for k, fn in enumerate(fns):
            dist.barrier(group=group)  # type: ignore[arg-type]
            start = time.perf_counter()
            fn()
            if turn:
                out[k].append(time.perf_counter() - start)
    return out


def synchronous_times(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Median seconds of each of ``fns`` as a collective step runs it: in
    :func:`interleaved` turns, every rank starts each call at a barrier and the call lasts
    until the slowest rank is done (per call, the max over ranks). Ranks sharing cores do
    not finish together, and a step waits for the last of them (a per-rank median would
    miss it); the turns let load that drifts hit every function alike.

    Example:
        >>> small, large = synchronous_times([step_on(2), step_on(16)], 7)  # doctest: +SKIP
    """
    import torch.distributed as dist

    mine = interleaved(fns, repeat)
    every: list[list[list[float]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    return [statistics.median(max(r[k][t] for r in every) for t in range(repeat))
            for k in range(len(fns))]


def synchronous_time(fn: Callable[[], object], repeat: int) -> float:
    """:func:`synchronous_times` of one function."""
    return synchronous_times([fn], repeat)[0]
