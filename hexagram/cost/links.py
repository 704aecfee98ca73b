"""A running job's link, measured: allreduce at a few sizes, in interleaved turns
(:func:`hexagram.cost.stopwatch.interleaved`), fitted to a hop latency and a rate
(:func:`hexagram.cost.fit.fit_allreduce`), on the group's device (CPU with gloo, GPU with
NCCL).

Example:
    >>> fit = fit_links()                 # every rank of the job   # doctest: +SKIP
    >>> fit["latency_us"], fit["gbps"]                              # doctest: +SKIP
    (212.4, 3.1)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from hexagram.comm.device import group_device
from hexagram.cost.fit import fit_allreduce
from hexagram.cost.stopwatch import interleaved
from hexagram.errors import HexagramError

__all__ = ["LINK_SIZES", "fit_links"]

#: allreduce sizes (float64 elements) of the link fit: the largest, 8 MB, takes ~10-20 ms
#: on gloo, enough for the byte term to stand out of the latency noise at 4 ranks
LINK_SIZES = (1_000, 64_000, 256_000, 1_000_000)


def _reducer(x: torch.Tensor, group: object) -> Callable[[], None]:
    def run() -> None:
        dist.all_reduce(x, group=group)  # type: ignore[arg-type]
        if x.is_cuda:
            torch.cuda.synchronize()
    return run


def fit_links(sizes: tuple[int, ...] = LINK_SIZES, repeat: int = 5, group: object = None,
              stat: str = "min") -> dict[str, float]:
    """In a running job (collective over ``group``): allreduce times at ``sizes`` (float64
    elements, timed in interleaved turns, the least or the median per size: ``stat``)
    fitted to the hop latency (``latency_us``) and rate (``gbps``, Gbit/s). Every rank
    fits the slowest rank's times, so all agree. If the times do not grow with the size,
    the sizes are taken 4x larger, twice at most, before giving up.

    Raises:
        HexagramError: the times never grew with the size.
    """
    n = dist.get_world_size(group)  # type: ignore[arg-type]
    if n == 1:
        return {"latency_us": 0.0, "gbps": 100.0}
    for attempt in range(3):
        counts = [c * 4 ** attempt for c in sizes]
        bufs = [torch.zeros(c, dtype=torch.float64, device=group_device(group))
                for c in counts]
        runs = interleaved([_reducer(b, group) for b in bufs], repeat, group)
        pick = min if stat == "min" else statistics.median
        times = [float(pick(r)) for r in runs]
        every = torch.tensor(times, dtype=torch.float64, device=group_device(group))
        dist.all_reduce(every, op=dist.ReduceOp.MAX, group=group)  # type: ignore[arg-type]
        try:
            fit = fit_allreduce(n, [8.0 * c for c in counts], every.tolist())
        except HexagramError:
            if attempt == 2:
                raise
            continue
        return {"latency_us": fit.latency_s * 1e6, "gbps": fit.rate_bps * 8 / 1e9}
    raise AssertionError("unreachable")
