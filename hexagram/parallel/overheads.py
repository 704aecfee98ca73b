"""Measured framework overheads the cost model adds to its roofline and alpha-beta terms.

Each figure is a residual: a tiny workload is timed on every rank of the running job
(median of ``repeat`` runs, so ranks sharing cores see each other), and the cost model's
own prediction of that workload (compute and collectives from the calibrated
:class:`~hexagram.parallel.cluster.Cluster`) is subtracted. What is left is what the
executor's machinery adds per unit:

- ``tp_overhead_us``: one column-wise and one row-wise ``nn.Linear`` on a DTensor mesh of all
  ranks (``parallelize_module``), against the same module unsharded; per linear.
- ``zero_overhead_us``: the same two linears, each an FSDP2 ``fully_shard`` unit over all
  ranks; per unit and micro-batch.
- ``microbatch_overhead_us``: a ``torch.distributed.pipelining`` 1F1B pipeline of one tiny
  linear per rank, timed at two micro-batch counts; the slope per micro-batch minus the
  modelled stage latency (compute + activation/gradient transfer).
- ``step_overhead_us``: the end-of-step barrier every step pays.

Example:
    >>> framework_overheads(cluster, torch.float64)             # doctest: +SKIP
    {'tp_overhead_us': 310.2, 'zero_overhead_us': 905.1, ...}
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from hexagram.parallel.cluster import Cluster, Submesh
from hexagram.parallel.cost import Mesh

__all__ = ["framework_overheads"]

_ROWS = 4  # samples of the tiny workloads


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    from hexagram.parallel.calibrate import _best_time

    dist.barrier()
    return _best_time(fn, repeat, "median")


def _tiny_mlp(width: int, dtype: torch.dtype, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(),
                         nn.Linear(2 * width, width)).to(dtype=dtype, device=device)


def _step(module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        module(x).sum().backward()
    return run


def _tp(cluster: Cluster, dtype: torch.dtype, device: torch.device, repeat: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n = dist.get_world_size()
    width = 8 * n
    x = torch.randn(_ROWS, width, dtype=dtype, device=device)
    plain = _median_time(_step(_tiny_mlp(width, dtype, device), x), repeat)
    sharded = parallelize_module(_tiny_mlp(width, dtype, device),
                                 init_device_mesh(device.type, (n,)),
                                 {"0": ColwiseParallel(), "2": RowwiseParallel()})
    measured = _median_time(_step(sharded, x), repeat)
    mesh = Mesh(cluster=cluster, d=1, t=n, b=_ROWS, microbatches=1)
    # the model's collectives: backward allreduce of the colwise input's gradient,
    # forward allreduce of the rowwise partial output
    nbytes = width * _ROWS * cluster.dtype_bytes
    modelled = 2 * mesh.collective("allreduce", "t", nbytes)
    return (measured - plain - modelled) / 2


def _zero(cluster: Cluster, dtype: torch.dtype, device: torch.device, repeat: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, share_comm_ctx

    from hexagram.parallel.zero import InPlaceReduceScatter

    n = dist.get_world_size()
    width = 8 * n
    x = torch.randn(_ROWS, width, dtype=dtype, device=device)
    plain = _median_time(_step(_tiny_mlp(width, dtype, device), x), repeat)
    model = _tiny_mlp(width, dtype, device)
    mesh = init_device_mesh(device.type, (n,))
    units = [fully_shard(model[i], mesh=mesh) for i in (0, 2)]
    if "gloo" in str(dist.get_backend()).lower():
        for unit in units:
            unit.set_custom_reduce_scatter(InPlaceReduceScatter())
    share_comm_ctx(units)
    measured = _median_time(_step(model, x), repeat)
    d_mesh = Mesh(cluster=cluster, d=n, t=1, b=_ROWS, microbatches=1)
    modelled = 0.0
    for i in (0, 2):  # ZeRO-3 per micro-batch: gather for forward and backward, then scatter
        pbytes = sum(p.numel() for p in _tiny_mlp(width, dtype, torch.device("meta"))[i]
                     .parameters()) * cluster.dtype_bytes
        modelled += 2 * d_mesh.collective("allgather", "d", pbytes) + \
            d_mesh.collective("reduce_scatter", "d", pbytes)
    return (measured - plain - modelled) / 2


def _pipeline_time(microbatches: int, dtype: torch.dtype, device: torch.device,
                   repeat: int) -> float:
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
    return _median_time(step, repeat)


def _microbatch(cluster: Cluster, dtype: torch.dtype, device: torch.device, repeat: int,
                barrier: float) -> tuple[float, float]:
    """(per micro-batch and stage, fixed per step) seconds of a pipeline of all ranks."""
    n = dist.get_world_size()
    counts = (n, 3 * n)
    times = [_pipeline_time(b, dtype, device, max(3, repeat // 3)) for b in counts]
    slope = (times[1] - times[0]) / (counts[1] - counts[0])
    from hexagram.parallel.inter import transfer_time

    mesh = Mesh(cluster=cluster, d=1, t=1, b=_ROWS, microbatches=counts[0])
    width = 16
    modelled = mesh.compute(2 * width * width * _ROWS, 3 * width * width * cluster.dtype_bytes) \
        + transfer_time(cluster, Submesh(1, 1), width * _ROWS * cluster.dtype_bytes)
    per_mb = slope - modelled
    fixed = times[0] - (n + counts[0] - 1) * slope - barrier
    return per_mb, fixed


def framework_overheads(cluster: Cluster, dtype: torch.dtype = torch.float64,
                        repeat: int = 15) -> dict[str, float]:
    """This rank's view of the overheads (microseconds, clipped at 0); collective: every
    rank of the job calls it. ``cluster``: the job's calibrated compute and links."""
    from hexagram.parallel.calibrate import _default_device

    device = _default_device()
    barrier = _median_time(dist.barrier, repeat)
    tp = _tp(cluster, dtype, device, repeat)
    zero = _zero(cluster, dtype, device, repeat)
    per_mb, fixed = _microbatch(cluster, dtype, device, repeat, barrier)
    out = {"tp_overhead_us": tp, "zero_overhead_us": zero, "microbatch_overhead_us": per_mb,
           "step_overhead_us": barrier, "pipeline_fixed_us": fixed}
    return {k: max(0.0, v * 1e6) for k, v in out.items()}
