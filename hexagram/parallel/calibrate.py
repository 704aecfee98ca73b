"""Calibrate a :class:`Cluster` by measuring this machine (compute, memory, gloo links).

- compute: a square matmul (FLOP/s), a large add (memory GB/s), a tiny op (fixed cost);
- links: allreduce at four sizes (8 KB to 8 MB) between local ranks, timed in interleaved
  turns (on the runtime's device: CPU with gloo, GPU with NCCL), fitted to the ring's
  hop latency and rate (:func:`hexagram.cost.links.fit_links`).

The stopwatch (:mod:`hexagram.cost.stopwatch`) and the fits (:mod:`hexagram.cost.fit`)
are the cost model's own; their names stay importable from here.

Example:
    >>> c = calibrated_cluster(devices=2)                         # doctest: +SKIP
    >>> c.device_tflops < 1                                       # doctest: +SKIP
    True
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from hexagram.cost.fit import fit_allreduce
from hexagram.cost.links import LINK_SIZES, fit_links
from hexagram.cost.stopwatch import (
    best_time,
    default_device,
    interleaved,
    synchronous_time,
    synchronous_times,
)
from hexagram.parallel.cluster import Cluster

__all__ = ["LINK_SIZES", "calibrated", "calibrated_cluster", "fit_alpha_beta", "fit_links",
           "interleaved", "job_worker", "link_worker", "measure_compute", "measure_job",
           "measure_links", "synchronous_time", "synchronous_times", "with_model_figures"]


def measure_compute(dtype: torch.dtype = torch.float64, size: int = 256, repeat: int = 10,
                    device: torch.device | None = None, stat: str = "min") -> dict[str, float]:
    """Achieved TFLOP/s, memory GB/s and per-op overhead (us) of this process on ``device``
    (default: the runtime's, :func:`~hexagram.cost.stopwatch.default_device`); ``stat``:
    see :func:`~hexagram.cost.stopwatch.best_time`."""
    dev = device or default_device()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a = torch.randn(size, size, dtype=dtype, device=dev)
    t_mm = best_time(lambda: (a @ a, sync()), repeat, stat)
    big = torch.randn(4_000_000, dtype=dtype, device=dev)
    t_add = best_time(lambda: (big + big, sync()), repeat, stat)
    # fixed cost of one operator, forward + backward through nn.Module (the model's unit)
    lin = torch.nn.Linear(4, 4).to(dtype=dtype, device=dev)
    tiny = torch.randn(2, 4, dtype=dtype, device=dev)
    t_op = best_time(lambda: lin(tiny).sum().backward(), repeat * 10, stat) / 3 / 2
    return {"device_tflops": 2 * size ** 3 / t_mm / 1e12,
            "memory_gbps": 3 * big.numel() * big.element_size() / t_add / 1e9,
            "op_overhead_us": t_op * 1e6}


def fit_alpha_beta(ranks: int, nbytes: list[float], times: list[float]) -> dict[str, float]:
    """:func:`~hexagram.cost.fit.fit_allreduce` in the planner's units: ``latency_us`` of a
    hop and the rate in ``gbps`` (Gbit/s).

    Example:
        >>> f = fit_alpha_beta(4, [0.0, 8e6], [6e-3, 6e-3 + 1.5 * 8e6 / 1e9])
        >>> round(f["latency_us"]), round(f["gbps"], 3)
        (1000, 8.0)
    """
    fit = fit_allreduce(ranks, nbytes, times)
    return {"latency_us": fit.latency_s * 1e6, "gbps": fit.rate_bps * 8 / 1e9}


def link_worker(sizes: tuple[int, ...] = LINK_SIZES, repeat: int = 5) -> dict[str, float]:
    """Run on every rank: :func:`fit_links` over all ranks."""
    from hexagram import runtime as hx  # init() only: the runtime, not the package root

    hx.init()
    return fit_links(sizes, repeat)


def measure_links(world_size: int = 2, timeout: float = 120.0) -> dict[str, float]:
    """Latency and rate of gloo allreduce between ``world_size`` local ranks."""
    from hexagram.launch import run_local

    return dict(run_local(link_worker, world_size, timeout=timeout)[0])


def measure_job(dtype: torch.dtype = torch.float64, repeat: int = 15,
                model: torch.nn.Module | None = None, inputs: object = None,
                targets: object = None, per_host: int = 0) -> dict[str, float]:
    """In a running job, every rank at once: compute (median, so ranks sharing cores see
    each other), links, and the framework overheads of :mod:`hexagram.parallel.overheads`
    fitted against the cost model's own formulas. With ``model`` and ``inputs`` (the
    job's batch; ``targets`` None: the output's sum is the loss) the overheads are
    measured on layers of the model's own shape and the model's step is measured too
    (:func:`~hexagram.parallel.overheads.model_compute_scale`: ``compute_scale`` and
    ``cores``), and so is its exact data-parallel gradient sync
    (:func:`~hexagram.parallel.dpsync.measure_dp_sync`: ``dp_sync_ms``,
    ``dp_sync_scale``). With ``per_host`` ranks per host and more than one host, the
    links inside and between hosts are fitted apart too
    (:func:`~hexagram.parallel.host_links.fit_host_links`: ``intra_*``, ``inter_*``), and
    the framework overheads and the model's sync are priced on them (DTensor's measured
    inside a host). Values are the median over ranks, the same on every rank.

    Example:
        >>> figures = measure_job(torch.float64, model=model, inputs=x)   # doctest: +SKIP
        >>> cluster = with_model_figures(calibrated(figures, 2, torch.float64), figures)
        ... # doctest: +SKIP
    """
    import torch.distributed as dist

    from hexagram.comm.device import group_device
    from hexagram.parallel.dpsync import measure_dp_sync
    from hexagram.parallel.host_links import fit_host_links, on_hosts
    from hexagram.parallel.overheads import (
        framework_overheads,
        model_compute_scale,
        model_linear_shape,
    )

    world = dist.get_world_size()
    shape = model_linear_shape(model, inputs, world) if model is not None else None
    dist.barrier()
    comp = measure_compute(dtype, stat="median")
    links = fit_links(repeat=max(5, repeat // 2), stat="median")
    # ZeRO's gradient reduce-scatter runs as an allreduce on gloo (parallel/zero.py)
    mine = {**comp, **links, "zero_rs_as_allreduce": float("gloo" in str(
        dist.get_backend()).lower())}
    if 1 < per_host < world:  # one rank per host: the all-rank fit is the network's
        mine.update(fit_host_links(per_host, repeat=max(5, repeat // 2)))
    mine.update(framework_overheads(on_hosts(calibrated(mine, world, dtype), mine, per_host),
                                    dtype, repeat, shape))
    every: list[dict[str, float]] = [{} for _ in range(world)]
    dist.all_gather_object(every, mine)
    out = {k: statistics.median(r[k] for r in every) for k in mine}
    if model is not None:
        cluster = on_hosts(calibrated(out, world, dtype), out, per_host)
        out.update(model_compute_scale(model, inputs, targets, cluster))
        out.update(measure_dp_sync(model, cluster, group_device(None)))
    return out


def job_worker(dtype: torch.dtype = torch.float64, repeat: int = 15) -> dict[str, float]:
    """Run on every rank: :func:`measure_job`."""
    from hexagram import runtime as hx  # init() only: the runtime, not the package root

    hx.init()
    return measure_job(dtype, repeat)


def calibrated(measured: dict[str, float], devices: int, dtype: torch.dtype) -> Cluster:
    """A one-host :class:`Cluster` of ``devices`` ranks from :func:`measure_job`'s figures
    (overheads absent from ``measured`` stay 0; ``zero_rs_as_allreduce``, set on gloo,
    prices ZeRO's reduce-scatter as the allreduce it runs as; the model's
    ``compute_scale`` and ``cores`` are not applied: :func:`with_model_figures` does)."""
    keys = ("tp_overhead_us", "zero_overhead_us", "microbatch_overhead_us", "step_overhead_us")
    overheads: dict[str, Any] = {k: measured[k] for k in keys if k in measured}
    if measured.get("zero_rs_as_allreduce", 0.0) > 0:
        overheads["zero_grad_collective"] = "allreduce"
    return Cluster(hosts=1, devices_per_host=devices, intra_host_gbps=measured["gbps"],
                   inter_host_gbps=measured["gbps"], intra_latency_us=measured["latency_us"],
                   inter_latency_us=measured["latency_us"],
                   device_tflops=measured["device_tflops"], memory_gbps=measured["memory_gbps"],
                   op_overhead_us=measured["op_overhead_us"],
                   dtype_bytes=torch.empty((), dtype=dtype).element_size(),
                   device_memory_gb=4.0).replace(**overheads)


def with_model_figures(cluster: Cluster, measured: dict[str, float]) -> Cluster:
    """``cluster`` with the model's measured step applied, where ``measured`` has it: the
    compute fields scaled by ``work_scale`` and ``op_scale`` (measured at two batch sizes;
    else by ``compute_scale``), ``cores_per_host`` set from ``cores`` (one host; below
    the ranks per host: they share cores) and ``dp_sync_scale`` from the timed gradient
    sync. Without them: unchanged.

    Example:
        >>> c = with_model_figures(Cluster(devices_per_host=4, device_tflops=1.0),
        ...                        {"compute_scale": 2.0, "cores": 2.0})
        >>> c.device_tflops, c.cores_per_host
        (0.5, 2.0)
    """
    from hexagram.parallel.overheads import scale_compute

    if "work_scale" in measured:  # two batch sizes: rate and per-operator scales apart
        cluster = scale_compute(cluster, measured["work_scale"], measured["op_scale"])
    elif "compute_scale" in measured:
        cluster = scale_compute(cluster, measured["compute_scale"])
    cores = measured.get("cores", 0.0)
    if cluster.hosts == 1 and 1 <= cores < cluster.devices_per_host:
        cluster = cluster.replace(cores_per_host=float(cores))
    if measured.get("dp_sync_scale", 0.0) > 0:  # the model's own gradient sync, timed
        cluster = cluster.replace(dp_sync_scale=float(measured["dp_sync_scale"]))
    return cluster


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
