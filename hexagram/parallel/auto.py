"""One call: measure the cluster this job runs on, plan the model for it, apply the plan.

Every rank of a ``torchrun`` job calls :func:`auto` with the same model and example batch.
The cluster is measured in the job itself, with the calibration the benchmarks use
(:func:`hexagram.parallel.calibrate.measure_job`: compute rate, memory bandwidth and
per-operator cost with all ranks running; allreduce latency and rate over all ranks on the
runtime's device, CPU/gloo or GPU/NCCL; the measured overheads of DTensor, FSDP2 and
pipelining), then the model's own forward + backward is timed on every rank against the
roofline (:func:`hexagram.parallel.overheads.model_compute_scale`) and the compute fields
are scaled by the ratio. Rank 0 plans and broadcasts the plan, so every rank applies the
very same one.

Example:
    >>> import torch, hexagram.parallel as hp
    >>> model = hp.gpt(layers=2, hidden=64, heads=4, vocab=100, seq=16)
    >>> x = torch.randint(0, 100, (8, 16))
    >>> pm = hp.auto(model, x)                      # on every rank   # doctest: +SKIP
    >>> print(pm.report)                            # the plan, predicted time  # doctest: +SKIP
    >>> loss = pm.train_step(x, y)                  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from hexagram.errors import HexagramError
from hexagram.parallel.apply import LossFn, default_loss, parallelize
from hexagram.parallel.calibrate import (
    calibrated,
    measure_compute,
    measure_job,
    with_model_figures,
)
from hexagram.parallel.cluster import Cluster, Constraints
from hexagram.parallel.host_links import on_hosts
from hexagram.parallel.overheads import model_compute_scale
from hexagram.parallel.planner import plan
from hexagram.parallel.plans import Plan
from hexagram.parallel.runner import ParallelModel

if TYPE_CHECKING:
    from hexagram.runtime import Runtime

__all__ = ["auto", "measure_cluster"]


def _dtype_of(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def measure_cluster(dtype: torch.dtype = torch.float32, memory_gb: float | None = None,
                    model: nn.Module | None = None, example_inputs: Any = None,
                    targets: Any = None) -> Cluster:
    """The running job as a :class:`Cluster` (collective: every rank calls it).

    Hosts from the runtime (``world / local_world``); compute, the links inside and
    between hosts (fitted apart on more than one host:
    :func:`~hexagram.parallel.host_links.fit_host_links`), and the framework overheads from
    :func:`~hexagram.parallel.calibrate.measure_job` (median over ranks, so every rank gets
    the same figures). With ``model`` and ``example_inputs`` the compute fields are scaled
    by the model's measured / predicted step, the overheads are measured on layers of the
    model's shape, and a single host's ``cores_per_host`` is set from the measured cores
    (:func:`~hexagram.parallel.calibrate.measure_job`; ``targets`` None: the output's sum
    is the loss). ``memory_gb``: per device (default: the GPU's total memory,
    or 4 GB per CPU rank).

    Example:
        >>> cluster = measure_cluster(torch.float64)              # doctest: +SKIP
        >>> cluster.tp_overhead_us >= 0                           # doctest: +SKIP
        True
    """
    from hexagram import runtime as hx  # init() only: the runtime, not the package root

    rt = hx.init()
    per_host = _ranks_per_host(rt)
    with_model = model is not None and example_inputs is not None
    figures = _job_figures(rt, dtype, model if with_model else None, example_inputs, targets,
                           per_host)
    if memory_gb is None:
        memory_gb = _device_memory_gb(rt)
    cluster = _cluster_of(figures, rt.world_size // per_host, per_host, dtype, memory_gb)
    return with_model_figures(cluster, figures)


def _ranks_per_host(rt: Runtime) -> int:
    """The job's ranks per host, checked: the same power of two on every host."""
    per_host = rt.local_world_size
    if rt.world_size % per_host or per_host & (per_host - 1):
        raise HexagramError(f"auto needs the same power-of-two number of ranks on every "
                            f"host, got {rt.world_size} ranks with {per_host} on this one; "
                            f"build a Cluster by hand and pass cluster=")
    return per_host


def _job_figures(rt: Runtime, dtype: torch.dtype, model: nn.Module | None,
                 example_inputs: Any, targets: Any, per_host: int) -> dict[str, Any]:
    """The calibration figures of the running job (collective); ``model`` None: without
    the model's own step. One rank has no links and no parallel machinery to measure."""
    if rt.world_size > 1:
        return measure_job(dtype, model=model, inputs=example_inputs, targets=targets,
                           per_host=per_host)
    figures = {**measure_compute(dtype, device=rt.device, stat="median"),
               "latency_us": 0.0, "gbps": 100.0}
    if model is not None:
        figures.update(model_compute_scale(model, example_inputs, targets,
                                           calibrated(figures, 1, dtype)))
    return figures


def _device_memory_gb(rt: Runtime) -> float:
    """The GPU's total memory, or 4 GB per CPU rank."""
    if rt.device.type == "cuda":
        return torch.cuda.get_device_properties(rt.device).total_memory / 1e9
    return 4.0


def _cluster_of(figures: dict[str, Any], hosts: int, per_host: int, dtype: torch.dtype,
                memory_gb: float) -> Cluster:
    """The measured figures as a :class:`Cluster` (before the model's figures), built as
    the calibration builds it (:func:`~hexagram.parallel.calibrate.calibrated`: the
    framework overheads where measured, ZeRO's gradient reduction as the allreduce it runs
    as on gloo), laid out as hosts with the links inside and between them where they were
    fitted apart (:func:`~hexagram.parallel.host_links.on_hosts`)."""
    one_host = calibrated(figures, hosts * per_host, dtype).replace(device_memory_gb=memory_gb)
    return on_hosts(one_host, figures, per_host).replace(hosts=hosts, devices_per_host=per_host)


def auto(model: nn.Module, example_inputs: Any, constraints: Constraints | None = None,
         cluster: Cluster | None = None, loss_fn: LossFn = default_loss,
         leaf_modules: tuple[type, ...] = (), zero_stage: int = 3) -> ParallelModel:
    """Measure the job's cluster (unless ``cluster`` is given), plan, apply; returns the
    :class:`ParallelModel` with ``plan`` and a printable ``report``.

    Raises:
        HexagramError: ``cluster`` is for another number of devices than the job runs
            (the message names both); NoPlanFitsError, UntraceableModelError from planning.
    """
    from hexagram import runtime as hx  # init() only: the runtime, not the package root

    rt = hx.init()
    measured = cluster is None
    cluster = cluster or measure_cluster(_dtype_of(model), model=model,
                                         example_inputs=example_inputs)
    if cluster.devices != rt.world_size:
        raise HexagramError(f"the cluster has {cluster.devices} devices but this job runs "
                            f"{rt.world_size} ranks: plan for the running job (cluster=None) "
                            f"or launch {cluster.devices} ranks")
    box: list[Plan | None] = [None]
    if rt.rank == 0:
        box[0] = plan(model, example_inputs, cluster, constraints, leaf_modules)
    dist.broadcast_object_list(box, src=0)
    chosen = box[0]
    assert chosen is not None
    pm = parallelize(model, chosen, loss_fn, zero_stage, example_inputs=example_inputs)
    c = cluster
    pm.report = (f"{chosen}\n  {'measured' if measured else 'given'} cluster: "
                 f"{c.device_tflops * 1e3:.1f} GFLOP/s, {c.memory_gbps:.1f} GB/s, "
                 f"{c.op_overhead_us:.1f} us/op, {_links(c)}; overheads DTensor "
                 f"{c.tp_overhead_us:.0f} us/linear, FSDP2 {c.zero_overhead_us:.0f} us/unit, "
                 f"pipelining {c.microbatch_overhead_us:.0f} us/micro-batch, step "
                 f"{c.step_overhead_us:.0f} us")
    return pm


def _links(c: Cluster) -> str:
    """The report's links: one on one host, inside and between hosts otherwise."""
    inside = f"{c.intra_latency_us:.0f} us + {c.intra_host_gbps:.2f} Gbit/s"
    if c.hosts == 1:
        return f"links {inside}"
    return (f"links {inside} inside a host, {c.inter_latency_us:.0f} us + "
            f"{c.inter_host_gbps:.3f} Gbit/s between hosts")
