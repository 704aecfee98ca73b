"""Measured framework overheads the cost model adds to its roofline and alpha-beta terms.

Each figure is a residual: a workload is timed on every rank of the running job at once
(so ranks sharing cores see each other), in interleaved turns with its plain twin
(:func:`~hexagram.cost.stopwatch.interleaved`: load that drifts hits both alike, and
the median of the per-turn differences is kept), and the cost model's own prediction of
the difference (collectives from the calibrated
:class:`~hexagram.parallel.cluster.Cluster`) is subtracted. What is left is what the
executor's machinery adds per unit. The DTensor and FSDP2 workloads have the shape of the
job's model (:func:`model_linear_shape`: its largest linear, at the rows it sees per rank;
Alpa likewise profiles the model's own stages), since their cost grows with the tensors
they copy and a tiny layer under-prices it:

- ``tp_overhead_us``: a linear of the model's shape and its transpose, column-wise and
  row-wise on a DTensor mesh (``parallelize_module``) of all ranks, or of each host's
  ranks (every host at once) when ``cluster`` has more than one host, against the same two
  linears unsharded (whose compute, in the cost model's proportion, is the sharded one's
  compute); per linear.
- ``zero_overhead_us``: the same two linears, each an FSDP2 ``fully_shard`` unit over all
  ranks; per unit and micro-batch.
- ``microbatch_overhead_us``: a ``torch.distributed.pipelining`` 1F1B pipeline of one tiny
  linear per rank, timed at two micro-batch counts; the slope per micro-batch minus the
  modelled stage latency (compute + activation/gradient transfer).
- ``step_overhead_us``: the end-of-step barrier every step pays.

The model's own measurements (:func:`model_linear_shape`, and :func:`model_compute_scale`
with :func:`split_scale` and :func:`scale_compute`: the model's measured step against the
roofline's) are in :mod:`hexagram.parallel.model_scale`; they stay importable from here.

Example:
    >>> framework_overheads(cluster, torch.float64)             # doctest: +SKIP
    {'tp_overhead_us': 310.2, 'zero_overhead_us': 905.1, ...}
    >>> f = model_compute_scale(model, x, y, cluster)           # doctest: +SKIP
    >>> cluster = scale_compute(cluster, f["compute_scale"])    # doctest: +SKIP
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from hexagram.cost.stopwatch import default_device, interleaved, median_time
from hexagram.parallel.cluster import Cluster, Submesh
from hexagram.parallel.mesh import Mesh
from hexagram.parallel.model_scale import (
    LayerShape,
    model_compute_scale,
    model_linear_shape,
    scale_compute,
    split_scale,
)

__all__ = ["LayerShape", "framework_overheads", "model_compute_scale", "model_linear_shape",
           "scale_compute", "split_scale"]

_ROWS = 4  # samples of the tiny workloads


def _mlp(width: int, hidden: int, dtype: torch.dtype, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(),
                         nn.Linear(hidden, width)).to(dtype=dtype, device=device)


def _layers(shape: LayerShape | None, n: int) -> LayerShape:
    """The model's layer if its width splits over ``n`` ranks, else the tiny one."""
    if shape is not None and shape[1] % n == 0:
        return shape
    return 8 * n, 16 * n, _ROWS


def _mlp_roofline(cluster: Cluster, shape: LayerShape, split: int) -> float:
    """The cost model's seconds of the two-linear MLP, its width split ``split`` ways."""
    width, hidden, rows = shape
    mesh = Mesh(cluster=cluster, d=1, t=1, b=1, microbatches=1)
    nb = cluster.dtype_bytes
    lin = 2 * rows * width * hidden / split
    moved = (rows * (width + hidden / split) + width * hidden / split) * nb
    return 2 * mesh.compute(lin, moved) + mesh.compute(0.0, 2 * rows * hidden / split * nb)


def _step(module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        module(x).sum().backward()
    return run


def _median_diff(runs: list[list[float]], weight: float = 1.0) -> float:
    """Median over turns of ``runs[1] - weight x runs[0]``."""
    return statistics.median(b - weight * a for a, b in zip(runs[0], runs[1]))


def _tp(cluster: Cluster, dtype: torch.dtype, device: torch.device, repeat: int,
        shape: LayerShape | None) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    # over the ranks of one host, every host at once: the planner keeps tensor parallelism
    # inside a host (Alpa's submeshes), and across a slow network the collectives' time
    # would hide DTensor's own cost in the residual
    world, hosts = dist.get_world_size(), cluster.hosts
    n = world // hosts
    ranks = init_device_mesh(device.type, (world,)) if hosts == 1 else init_device_mesh(
        device.type, (hosts, n), mesh_dim_names=("host", "local"))["local"]
    width, hidden, rows = shape = _layers(shape, n)
    x = torch.randn(rows, width, dtype=dtype, device=device)
    sharded = parallelize_module(_mlp(width, hidden, dtype, device), ranks,
                                 {"0": ColwiseParallel(), "2": RowwiseParallel()})
    runs = interleaved([_step(_mlp(width, hidden, dtype, device), x), _step(sharded, x)],
                       repeat)
    # the sharded compute: the measured whole MLP in the cost model's proportion
    share = _mlp_roofline(cluster, shape, n) / _mlp_roofline(cluster, shape, 1)
    mesh = Mesh(cluster=cluster, d=1, t=n, b=rows, microbatches=1)
    # the model's collectives: backward allreduce of the colwise input's gradient,
    # forward allreduce of the rowwise partial output
    modelled = 2 * mesh.collective("allreduce", "t", width * rows * cluster.dtype_bytes)
    return (_median_diff(runs, share) - modelled) / 2


def _zero(cluster: Cluster, dtype: torch.dtype, device: torch.device, repeat: int,
          shape: LayerShape | None) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, share_comm_ctx

    from hexagram.parallel.zero import InPlaceReduceScatter

    n = dist.get_world_size()
    width, hidden, rows = _layers(shape, n)
    x = torch.randn(rows, width, dtype=dtype, device=device)
    model = _mlp(width, hidden, dtype, device)
    mesh = init_device_mesh(device.type, (n,))
    units = [fully_shard(model[i], mesh=mesh) for i in (0, 2)]
    if "gloo" in str(dist.get_backend()).lower():
        for unit in units:
            unit.set_custom_reduce_scatter(InPlaceReduceScatter())
    share_comm_ctx(units)
    runs = interleaved([_step(_mlp(width, hidden, dtype, device), x), _step(model, x)],
                       repeat)
    # the units span every rank: on several hosts their collectives cross the network
    d_mesh = Mesh(cluster=cluster, d=n, t=1, b=rows, microbatches=1,
                  spans_hosts=cluster.hosts > 1)
    # ZeRO-3 per micro-batch and unit: gather for forward and backward, then scatter
    pbytes = (width * hidden + hidden) * cluster.dtype_bytes, \
        (hidden * width + width) * cluster.dtype_bytes
    modelled = sum(2 * d_mesh.collective("allgather", "d", b) +
                   d_mesh.collective(cluster.zero_grad_collective, "d", b) for b in pbytes)
    return (_median_diff(runs) - modelled) / 2


def _pipeline_step(microbatches: int, dtype: torch.dtype, device: torch.device
                   ) -> Callable[[], None]:
    """One step of a 1F1B pipeline of one tiny linear per rank (collective)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    n, rank, width = dist.get_world_size(), dist.get_rank(), 16
    torch.manual_seed(rank)
    stage = PipelineStage(nn.Linear(width, width).to(dtype=dtype, device=device), rank, n,
                          device)
    schedule = Schedule1F1B(stage, n_microbatches=microbatches,
                            loss_fn=lambda out, target: ((out - target) ** 2).sum())
    x = torch.randn(_ROWS * microbatches, width, dtype=dtype, device=device)

    def step() -> None:
        if rank == 0:
            schedule.step(x)
        elif rank == n - 1:
            schedule.step(target=torch.zeros_like(x))
        else:
            schedule.step()
        dist.barrier()
    return step


def _microbatch(cluster: Cluster, dtype: torch.dtype, device: torch.device, repeat: int,
                barrier: float) -> tuple[float, float]:
    """(per micro-batch and stage, fixed per step) seconds of a pipeline of all ranks:
    ``n`` and ``3n`` micro-batches timed in interleaved turns, the median per-turn slope."""
    from hexagram.parallel.inter import transfer_time

    n = dist.get_world_size()
    counts = (n, 3 * n)
    runs = interleaved([_pipeline_step(b, dtype, device) for b in counts], repeat)
    slope = _median_diff(runs) / (counts[1] - counts[0])
    mesh = Mesh(cluster=cluster, d=1, t=1, b=_ROWS, microbatches=counts[0])
    width = 16
    modelled = mesh.compute(2 * width * width * _ROWS, 3 * width * width * cluster.dtype_bytes) \
        + transfer_time(cluster, Submesh(1, 1), width * _ROWS * cluster.dtype_bytes)
    per_mb = slope - modelled
    fixed = statistics.median(runs[0]) - (n + counts[0] - 1) * slope - barrier
    return per_mb, fixed


def framework_overheads(cluster: Cluster, dtype: torch.dtype = torch.float64,
                        repeat: int = 15, shape: LayerShape | None = None
                        ) -> dict[str, float]:
    """This rank's view of the overheads (microseconds, clipped at 0); collective: every
    rank of the job calls it. ``cluster``: the job's calibrated compute and links (on more
    than one host, its ranks laid out as hosts: DTensor is then measured inside a host);
    ``shape``: the model's layer (:func:`model_linear_shape`) that DTensor and FSDP2 are
    measured on (None, or a width that does not split over the ranks: a tiny one)."""
    device = default_device()
    barrier = median_time(dist.barrier, repeat)
    tp = _tp(cluster, dtype, device, repeat, shape)
    zero = _zero(cluster, dtype, device, repeat, shape)
    per_mb, fixed = _microbatch(cluster, dtype, device, repeat, barrier)
    out = {"tp_overhead_us": tp, "zero_overhead_us": zero, "microbatch_overhead_us": per_mb,
           "step_overhead_us": barrier, "pipeline_fixed_us": fixed}
    return {k: max(0.0, v * 1e6) for k, v in out.items()}


