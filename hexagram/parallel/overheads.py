"""Measured framework overheads the cost model adds to its roofline and alpha-beta terms.

Each figure is a residual: a workload is timed on every rank of the running job at once
(so ranks sharing cores see each other), in interleaved turns with its plain twin
(:func:`~hexagram.parallel.calibrate.interleaved`: load that drifts hits both alike, and
the median of the per-turn differences is kept), and the cost model's own prediction of
the difference (collectives from the calibrated
:class:`~hexagram.parallel.cluster.Cluster`) is subtracted. What is left is what the
executor's machinery adds per unit. The DTensor and FSDP2 workloads have the shape of the
job's model (:func:`model_linear_shape`: its largest linear, at the rows it sees per rank;
Alpa likewise profiles the model's own stages), since their cost grows with the tensors
they copy and a tiny layer under-prices it:

- ``tp_overhead_us``: a linear of the model's shape and its transpose, column-wise and
  row-wise on a DTensor mesh of all ranks (``parallelize_module``), against the same two
  linears unsharded (whose compute, in the cost model's proportion, is the sharded one's
  compute); per linear.
- ``zero_overhead_us``: the same two linears, each an FSDP2 ``fully_shard`` unit over all
  ranks; per unit and micro-batch.
- ``microbatch_overhead_us``: a ``torch.distributed.pipelining`` 1F1B pipeline of one tiny
  linear per rank, timed at two micro-batch counts; the slope per micro-batch minus the
  modelled stage latency (compute + activation/gradient transfer).
- ``step_overhead_us``: the end-of-step barrier every step pays.

:func:`model_compute_scale` measures the model itself (Alpa profiles each stage on its
mesh; here one forward + backward of the whole model on every rank at once, at the
per-rank share of the batch) against the roofline's prediction of the same step. The
ratio covers what the microbenchmarks miss: the model's own operator shapes and kernels
(e.g. float64 GELU and attention on CPU), and ranks sharing cores while they all compute
(4 ranks on 2 cores: each runs at half speed). :func:`scale_compute` applies it to a
cluster's compute fields. The same function measures the cores the ranks share
(``cores``, for ``Cluster.cores_per_host``).

Example:
    >>> framework_overheads(cluster, torch.float64)             # doctest: +SKIP
    {'tp_overhead_us': 310.2, 'zero_overhead_us': 905.1, ...}
    >>> f = model_compute_scale(model, x, y, cluster)           # doctest: +SKIP
    >>> cluster = scale_compute(cluster, f["compute_scale"])    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hexagram.parallel.cluster import Cluster, Submesh
from hexagram.parallel.cost import Mesh

__all__ = ["LayerShape", "framework_overheads", "model_compute_scale", "model_linear_shape",
           "scale_compute", "split_scale"]

_ROWS = 4  # samples of the tiny workloads


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    from hexagram.parallel.calibrate import _best_time

    dist.barrier()
    return _best_time(fn, repeat, "median")

#: (in_features, out_features, rows) of the layers the overheads are measured on
LayerShape = tuple[int, int, int]


def _batched(inputs: Any, who: str) -> torch.Tensor:
    """The batch tensor of ``inputs`` (it, or the first of a tuple), checked."""
    first = inputs[0] if isinstance(inputs, tuple | list) else inputs
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise TypeError(f"{who} needs a batched tensor (or a tuple starting with one) as "
                        f"inputs, got {type(first).__name__}")
    return first


@contextlib.contextmanager
def _buffers_kept(model: nn.Module) -> Iterator[None]:
    """Run timing or probing steps on ``model``, then restore its buffers (batch-norm
    statistics) as they were."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])


def model_linear_shape(model: nn.Module, inputs: Any, world: int = 1) -> LayerShape | None:
    """The shape of the model's largest ``nn.Linear`` (most parameters, first on ties) and
    the rows it sees in a forward on ``batch // world`` samples of ``inputs``: the layer
    the framework overheads are measured on (None: the model has no linear). Buffers are
    restored afterwards.

    Example:
        >>> m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        >>> model_linear_shape(m, torch.zeros(16, 8), world=2)
        (8, 32, 8)
    """
    first = _batched(inputs, "model_linear_shape")
    seen: dict[nn.Linear, int] = {}

    def hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
        assert isinstance(mod, nn.Linear)
        seen.setdefault(mod, args[0].numel() // mod.in_features)

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    handles = [m.register_forward_pre_hook(hook) for m in linears]
    x = _share(inputs, first.shape[0], max(1, first.shape[0] // world))
    try:
        with _buffers_kept(model), torch.no_grad():
            model(*(x if isinstance(x, tuple | list) else (x,)))
    finally:
        for h in handles:
            h.remove()
    if not seen:
        return None
    big = max(seen, key=lambda m: m.in_features * m.out_features)  # first on ties
    return big.in_features, big.out_features, seen[big]


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

    from hexagram.parallel.calibrate import interleaved

    n = dist.get_world_size()
    width, hidden, rows = shape = _layers(shape, n)
    x = torch.randn(rows, width, dtype=dtype, device=device)
    sharded = parallelize_module(_mlp(width, hidden, dtype, device),
                                 init_device_mesh(device.type, (n,)),
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

    from hexagram.parallel.calibrate import interleaved
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
    d_mesh = Mesh(cluster=cluster, d=n, t=1, b=rows, microbatches=1)
    # ZeRO-3 per micro-batch and unit: gather for forward and backward, then scatter
    pbytes = (width * hidden + hidden) * cluster.dtype_bytes, \
        (hidden * width + width) * cluster.dtype_bytes
    modelled = sum(2 * d_mesh.collective("allgather", "d", b) +
                   d_mesh.collective("reduce_scatter", "d", b) for b in pbytes)
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
    from hexagram.parallel.calibrate import interleaved
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
    rank of the job calls it. ``cluster``: the job's calibrated compute and links;
    ``shape``: the model's layer (:func:`model_linear_shape`) that DTensor and FSDP2 are
    measured on (None, or a width that does not split over the ranks: a tiny one)."""
    from hexagram.parallel.calibrate import _default_device

    device = _default_device()
    barrier = _median_time(dist.barrier, repeat)
    tp = _tp(cluster, dtype, device, repeat, shape)
    zero = _zero(cluster, dtype, device, repeat, shape)
    per_mb, fixed = _microbatch(cluster, dtype, device, repeat, barrier)
    out = {"tp_overhead_us": tp, "zero_overhead_us": zero, "microbatch_overhead_us": per_mb,
           "step_overhead_us": barrier, "pipeline_fixed_us": fixed}
    return {k: max(0.0, v * 1e6) for k, v in out.items()}


def _share(value: Any, batch: int, rows: int) -> Any:
    """The first ``rows`` samples of every tensor whose first dimension is the batch."""
    if isinstance(value, torch.Tensor):
        return value[:rows] if value.dim() and value.shape[0] == batch else value
    if isinstance(value, tuple | list):
        return type(value)(_share(v, batch, rows) for v in value)
    return value


def _output_sum(output: Any, _targets: Any) -> torch.Tensor:
    """Stand-in loss when no targets are given: the sum of the (first) output."""
    first = output[0] if isinstance(output, tuple | list) else output
    return first.sum()


def _predicted_step(model: nn.Module, inputs: Any, *clusters: Cluster) -> list[float]:
    """The cost model's seconds of one forward + backward of ``model`` on one device of
    each of ``clusters`` (the model captured once)."""
    from hexagram.parallel.graph import capture
    from hexagram.parallel.intra import fastest

    graph = capture(model, inputs)
    meshes = [Mesh(cluster=c.replace(hosts=1, devices_per_host=1), d=1, t=1, b=graph.batch,
                   microbatches=1) for c in clusters]
    return [sum(fastest(layer, mesh).time for layer in graph.layers) for mesh in meshes]


def model_compute_scale(model: nn.Module, inputs: Any, targets: Any, cluster: Cluster,
                        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                        repeat: int = 7) -> dict[str, float]:
    """Measured / predicted seconds of one forward + backward of ``model`` (collective:
    every rank calls it with the same model and batch, and they all compute at once).

    Each rank runs ``repeat`` steps back to back on its share of the batch (``batch //
    world`` samples), long enough for ranks that share a core to slow each other; the
    median step, median over ranks, is divided by the cost model's prediction of the same
    step from ``cluster``'s compute fields (``compute_scale``). With more than one rank the
    same is timed on the whole batch per rank (what a rank computes when the plan
    replicates a layer over tensor-parallel ranks), and the two points split the scale
    (:func:`split_scale`): ``work_scale`` for the roofline's rate terms, which grow with the
    batch, ``op_scale`` for its fixed per-operator cost. The loss is ``loss_fn`` (default:
    cross-entropy, or the output's sum when ``targets`` is None). The model's gradients are
    cleared and its buffers (e.g. batch-norm statistics) restored afterwards. Also returns
    ``model_step_ms`` (measured), ``model_predicted_ms`` and, for diagnosis,
    ``model_step_alone_ms``: rank 0's step while the other ranks wait (step / alone ~ how
    much the ranks slow each other), and ``cores``.

    Example:
        >>> figs = model_compute_scale(model, x, y, cluster)      # doctest: +SKIP
        >>> figs["compute_scale"] > 1                             # doctest: +SKIP
        True
    """
    first = _batched(inputs, "model_compute_scale")
    batch = first.shape[0]
    rows = max(1, batch // dist.get_world_size())
    with _buffers_kept(model):
        step_s, alone_s, predicted, work = _timed(model, inputs, targets, loss_fn, cluster,
                                                  batch, rows, repeat, alone=True)
        out = {"compute_scale": max(1e-3, step_s / predicted), "model_step_ms": step_s * 1e3,
               "model_predicted_ms": predicted * 1e3, "model_step_alone_ms": alone_s * 1e3,
               "cores": _cores(step_s, alone_s, first.device)}
        if rows < batch:
            whole_s, _, whole_pred, whole_work = _timed(model, inputs, targets, loss_fn,
                                                        cluster, batch, batch, repeat)
            out.update(split_scale((step_s, predicted - work, work),
                                   (whole_s, whole_pred - whole_work, whole_work)))
            out["model_step_whole_batch_ms"] = whole_s * 1e3
    model.zero_grad(set_to_none=True)
    return out


def _timed(model: nn.Module, inputs: Any, targets: Any,
           loss_fn: Callable[[Any, Any], torch.Tensor] | None, cluster: Cluster,
           batch: int, rows: int, repeat: int, alone: bool = False
           ) -> tuple[float, float, float, float]:
    """The model's step on ``rows`` samples per rank, every rank at once (median over
    ranks), rank 0's step alone (when ``alone``), and the roofline's step and its rate
    part (the same without the per-operator cost)."""
    from hexagram.parallel.apply import default_loss
    from hexagram.parallel.calibrate import _best_time

    x, y = _share(inputs, batch, rows), _share(targets, batch, rows)
    loss = loss_fn or (default_loss if targets is not None else _output_sum)
    args = x if isinstance(x, tuple | list) else (x,)

    def step() -> None:
        loss(model(*args), y).backward()

    measured = _median_time(step, repeat)
    dist.barrier()  # diagnostic: rank 0 alone while the others wait
    solo = _best_time(step, repeat, "median") if alone and dist.get_rank() == 0 else 0.0
    dist.barrier()
    every: list[tuple[float, float]] = [(0.0, 0.0)] * dist.get_world_size()
    dist.all_gather_object(every, (measured, solo))
    whole, rate = _predicted_step(model, x, cluster, cluster.replace(op_overhead_us=0.0))
    return statistics.median(m for m, _ in every), every[0][1], whole, rate


def split_scale(small: tuple[float, float, float], large: tuple[float, float, float]
                ) -> dict[str, float]:
    """``work_scale`` and ``op_scale`` from two measured steps, each ``(measured s,
    predicted per-operator s, predicted rate s)``: ``measured = op_scale x ops + work_scale
    x work`` at both points. A negative per-operator share is taken as 0 (the rate scale
    then fits both points through the origin); without a rate difference, or when the
    larger step measured no slower, one scale (the small point's ratio) serves both.

    Example:
        >>> split_scale((0.10, 0.02, 0.03), (0.34, 0.02, 0.12))
        {'work_scale': 2.666667, 'op_scale': 1.0}
    """
    (m1, o1, w1), (m2, o2, w2) = small, large
    single = m1 / max(o1 + w1, 1e-12)
    det = o1 * w2 - o2 * w1  # the 2 x 2 system [o w] [op work]' = m
    if w2 - w1 <= 1e-12 or m2 <= m1 or abs(det) <= 1e-18:
        return {"work_scale": round(single, 6), "op_scale": round(single, 6)}
    work, op = (o1 * m2 - o2 * m1) / det, (m1 * w2 - m2 * w1) / det
    if op < 0:
        work, op = (m1 * w1 + m2 * w2) / (w1 * w1 + w2 * w2), 0.0
    return {"work_scale": round(max(work, 1e-3), 6), "op_scale": round(op, 6)}


def _cores(step_s: float, alone_s: float, device: torch.device) -> float:
    """Effective cores of the job's ranks: ``world x alone / together``, in [1, ranks]
    and at most the CPUs this process may run on; 0 (no sharing) off the CPU."""
    import os

    if device.type != "cpu" or step_s <= 0:
        return 0.0
    world = dist.get_world_size()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or world)
    return max(1.0, min(float(world), float(cpus), world * alone_s / step_s))


def scale_compute(cluster: Cluster, factor: float, op_factor: float | None = None
                  ) -> Cluster:
    """``cluster`` with its compute ``factor`` times slower: matmul rate and memory bandwidth
    divided, per-operator cost multiplied by ``op_factor`` (default ``factor``; links and
    framework overheads unchanged).

    Example:
        >>> c = scale_compute(Cluster(device_tflops=10.0, op_overhead_us=5.0), 2.0)
        >>> c.device_tflops, c.op_overhead_us
        (5.0, 10.0)
        >>> scale_compute(c, 2.0, 0.5).op_overhead_us
        5.0
    """
    ops = factor if op_factor is None else op_factor
    if not factor > 0 or not ops >= 0:
        raise ValueError(f"scale_compute: factor must be > 0 and op_factor >= 0, got "
                         f"{factor} and {op_factor}")
    return cluster.replace(device_tflops=cluster.device_tflops / factor,
                           memory_gbps=cluster.memory_gbps / factor,
                           op_overhead_us=cluster.op_overhead_us * ops)
