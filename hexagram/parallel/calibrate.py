"""Calibrate a :class:`Cluster` by measuring this machine (compute, memory, gloo links).

- compute: a square matmul (FLOP/s), a large add (memory GB/s), a tiny op (fixed cost);
- links: allreduce of a small and a large tensor between local ranks (on the runtime's
  device: CPU with gloo, GPU with NCCL), fitted to the
  alpha-beta model ``t = 2(n-1) a + 2(n-1)/n X / w``.

Example:
    >>> c = calibrated_cluster(devices=2)                         # doctest: +SKIP
    >>> c.device_tflops < 1                                       # doctest: +SKIP
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from hexagram.parallel.cluster import Cluster

__all__ = ["calibrated", "calibrated_cluster", "fit_links", "job_worker", "link_worker",
           "measure_compute", "measure_job", "measure_links"]


def _best_time(fn: Callable[[], object], repeat: int, stat: str = "min") -> float:
    """Seconds of ``fn()`` after one warm-up call: the least (``stat="min"``) or the median
    (``"median"``: what a training step sees on a shared machine) of ``repeat`` runs."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) if stat == "min" else statistics.median(times)


def _default_device() -> torch.device:
    """The runtime's device when hexagram is initialised, else CUDA if present, else CPU."""
    from hexagram.runtime import get_runtime, is_initialized

    if is_initialized():
        return get_runtime().device
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def measure_compute(dtype: torch.dtype = torch.float64, size: int = 256, repeat: int = 10,
                    device: torch.device | None = None, stat: str = "min") -> dict[str, float]:
    """Achieved TFLOP/s, memory GB/s and per-op overhead (us) of this process on ``device``
    (default: the runtime's, see :func:`_default_device`); ``stat``: see :func:`_best_time`."""
    dev = device or _default_device()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a = torch.randn(size, size, dtype=dtype, device=dev)
    t_mm = _best_time(lambda: (a @ a, sync()), repeat, stat)
    big = torch.randn(4_000_000, dtype=dtype, device=dev)
    t_add = _best_time(lambda: (big + big, sync()), repeat, stat)
    # fixed cost of one operator, forward + backward through nn.Module (the model's unit)
    lin = torch.nn.Linear(4, 4).to(dtype=dtype, device=dev)
    tiny = torch.randn(2, 4, dtype=dtype, device=dev)
    t_op = _best_time(lambda: lin(tiny).sum().backward(), repeat * 10, stat) / 3 / 2
    return {"device_tflops": 2 * size ** 3 / t_mm / 1e12,
            "memory_gbps": 3 * big.numel() * big.element_size() / t_add / 1e9,
            "op_overhead_us": t_op * 1e6}


def fit_links(sizes: tuple[int, int] = (1_000, 2_000_000), repeat: int = 5,
              group: object = None, stat: str = "min") -> dict[str, float]:
    """In a running job (collective over ``group``): fit allreduce times to alpha (us) and
    rate (Gbit/s), on the runtime's device (CPU with gloo, GPU with NCCL); ``stat``: see
    :func:`_best_time`."""
    import torch.distributed as dist

    from hexagram.comm.device import group_device

    n = dist.get_world_size(group)  # type: ignore[arg-type]
    if n == 1:
        return {"latency_us": 0.0, "gbps": 100.0}
    times = []
    for count in sizes:
        x = torch.zeros(count, dtype=torch.float64, device=group_device(group))

        def reduce(x: torch.Tensor = x) -> None:
            dist.all_reduce(x, group=group)  # type: ignore[arg-type]
            if x.is_cuda:
                torch.cuda.synchronize()

        dist.barrier(group=group)  # type: ignore[arg-type]
        times.append(_best_time(reduce, repeat, stat))
    nbytes = [8 * s for s in sizes]
    per_byte = (times[1] - times[0]) / (nbytes[1] - nbytes[0])  # = 2(n-1)/n / w
    rate = 2 * (n - 1) / n / max(per_byte, 1e-15)
    alpha = max(0.0, (times[0] - 2 * (n - 1) / n * nbytes[0] / rate) / (2 * (n - 1)))
    return {"latency_us": alpha * 1e6, "gbps": rate * 8 / 1e9}


def link_worker(sizes: tuple[int, int] = (1_000, 2_000_000), repeat: int = 5
                ) -> dict[str, float]:
    """Run on every rank: :func:`fit_links` over all ranks."""
    import hexagram as hx

    hx.init()
    return fit_links(sizes, repeat)


def measure_links(world_size: int = 2, timeout: float = 120.0) -> dict[str, float]:
    """Latency and rate of gloo allreduce between ``world_size`` local ranks."""
    from hexagram.launch import run_local

    return dict(run_local(link_worker, world_size, timeout=timeout)[0])


def measure_job(dtype: torch.dtype = torch.float64, repeat: int = 15) -> dict[str, float]:
    """In a running job, every rank at once: compute (median, so ranks sharing cores see
    each other), links, and the framework overheads of :mod:`hexagram.parallel.overheads`
    fitted against the cost model's own formulas. Values are the median over ranks."""
    import torch.distributed as dist

    from hexagram.parallel.overheads import framework_overheads

    dist.barrier()
    comp = measure_compute(dtype, stat="median")
    links = fit_links((1_000, 250_000), repeat, stat="median")
    mine = {**comp, **links}
    mine.update(framework_overheads(calibrated(mine, dist.get_world_size(), dtype), dtype,
                                    repeat))
    every: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    return {k: statistics.median(r[k] for r in every) for k in mine}


def job_worker(dtype: torch.dtype = torch.float64, repeat: int = 15) -> dict[str, float]:
    """Run on every rank: :func:`measure_job`."""
    import hexagram as hx

    hx.init()
    return measure_job(dtype, repeat)


def calibrated(measured: dict[str, float], devices: int, dtype: torch.dtype) -> Cluster:
    """A one-host :class:`Cluster` of ``devices`` ranks from :func:`measure_job`'s figures
    (overheads absent from ``measured`` stay 0)."""
    keys = ("tp_overhead_us", "zero_overhead_us", "microbatch_overhead_us", "step_overhead_us")
    overheads: dict[str, float] = {k: measured[k] for k in keys if k in measured}
    return Cluster(hosts=1, devices_per_host=devices, intra_host_gbps=measured["gbps"],
                   inter_host_gbps=measured["gbps"], intra_latency_us=measured["latency_us"],
                   inter_latency_us=measured["latency_us"],
                   device_tflops=measured["device_tflops"], memory_gbps=measured["memory_gbps"],
                   op_overhead_us=measured["op_overhead_us"],
                   dtype_bytes=torch.empty((), dtype=dtype).element_size(),
                   device_memory_gb=4.0).replace(**overheads)


def calibrated_cluster(devices: int, dtype: torch.dtype = torch.float64,
                       timeout: float = 300.0) -> Cluster:
    """A one-host :class:`Cluster` of ``devices`` local ranks, measured on ``devices``
    ranks running together (:func:`job_worker`: compute, links, framework overheads)."""
    from hexagram.launch import run_local

    if devices == 1:
        comp = measure_compute(dtype, stat="median")
        return calibrated({**comp, "latency_us": 0.0, "gbps": 100.0}, 1, dtype)
    return calibrated(run_local(job_worker, devices, args=(dtype,), timeout=timeout)[0],
                      devices, dtype)
