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

import time
from collections.abc import Callable

import torch

from hexagram.parallel.cluster import Cluster

__all__ = ["calibrated_cluster", "fit_links", "link_worker", "measure_compute", "measure_links"]


def _best_time(fn: Callable[[], object], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _default_device() -> torch.device:
    """The runtime's device when hexagram is initialised, else CUDA if present, else CPU."""
    from hexagram.runtime import get_runtime, is_initialized

    if is_initialized():
        return get_runtime().device
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def measure_compute(dtype: torch.dtype = torch.float64, size: int = 256, repeat: int = 10,
                    device: torch.device | None = None) -> dict[str, float]:
    """Achieved TFLOP/s, memory GB/s and per-op overhead (us) of this process on ``device``
    (default: the runtime's, see :func:`_default_device`)."""
    dev = device or _default_device()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a = torch.randn(size, size, dtype=dtype, device=dev)
    t_mm = _best_time(lambda: (a @ a, sync()), repeat)
    big = torch.randn(4_000_000, dtype=dtype, device=dev)
    t_add = _best_time(lambda: (big + big, sync()), repeat)
    # fixed cost of one operator, forward + backward through nn.Module (the model's unit)
    lin = torch.nn.Linear(4, 4).to(dtype=dtype, device=dev)
    tiny = torch.randn(2, 4, dtype=dtype, device=dev)
    t_op = _best_time(lambda: lin(tiny).sum().backward(), repeat * 10) / 3 / 2
    return {"device_tflops": 2 * size ** 3 / t_mm / 1e12,
            "memory_gbps": 3 * big.numel() * big.element_size() / t_add / 1e9,
            "op_overhead_us": t_op * 1e6}


def fit_links(sizes: tuple[int, int] = (1_000, 2_000_000), repeat: int = 5,
              group: object = None) -> dict[str, float]:
    """In a running job (collective over ``group``): fit allreduce times to alpha (us) and
    rate (Gbit/s), on the runtime's device (CPU with gloo, GPU with NCCL)."""
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
        times.append(_best_time(reduce, repeat))
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


def calibrated_cluster(devices: int, dtype: torch.dtype = torch.float64) -> Cluster:
    """A one-host :class:`Cluster` of ``devices`` CPU ranks with this machine's rates."""
    comp = measure_compute(dtype)
    links = measure_links(min(devices, 4), timeout=300) if devices > 1 \
        else {"latency_us": 0.0, "gbps": 100.0}
    return Cluster(hosts=1, devices_per_host=devices, intra_host_gbps=links["gbps"],
                   inter_host_gbps=links["gbps"], intra_latency_us=links["latency_us"],
                   inter_latency_us=links["latency_us"], device_tflops=comp["device_tflops"],
                   memory_gbps=comp["memory_gbps"], op_overhead_us=comp["op_overhead_us"],
                   dtype_bytes=torch.empty((), dtype=dtype).element_size(),
                   device_memory_gb=4.0)
