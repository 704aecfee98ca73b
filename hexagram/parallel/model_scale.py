"""The job's model measured on every rank: the layer shape the framework overheads are timed
on, and how fast the model really computes against the cost model's roofline.

:func:`model_linear_shape` finds the model's largest linear and the rows it sees per rank
(:func:`hexagram.parallel.overheads.framework_overheads` times DTensor and FSDP2 on it).
:func:`model_compute_scale` measures the model itself (Alpa profiles each stage on its
mesh; here one forward + backward of the whole model on every rank at once, at the
per-rank share of the batch) against the roofline's prediction of the same step. The
ratio covers what the microbenchmarks miss: the model's own operator shapes and kernels
(e.g. float64 GELU and attention on CPU), and ranks sharing cores while they all compute
(4 ranks on 2 cores: each runs at half speed). :func:`scale_compute` applies it to a
cluster's compute fields. The same function measures the cores the ranks share
(``cores``, for ``Cluster.cores_per_host``). Every name here is also importable from
:mod:`hexagram.parallel.overheads`.

Example:
    >>> f = model_compute_scale(model, x, y, cluster)           # doctest: +SKIP
    >>> cluster = scale_compute(cluster, f["compute_scale"])    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hexagram.cost.stopwatch import best_time, synchronous_times
from hexagram.parallel.cluster import Cluster
from hexagram.parallel.mesh import Mesh

__all__ = ["LayerShape", "model_compute_scale", "model_linear_shape", "scale_compute",
           "split_scale"]


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

    Every rank runs ``repeat`` steps on its share of the batch (``batch // world``
    samples), each started at a barrier, so ranks that share a core slow each other; the
    median over steps of the slowest rank's step (what a plan's step waits for:
    :func:`~hexagram.cost.stopwatch.synchronous_times`) is divided by the cost
    model's prediction of the same step from ``cluster``'s compute fields
    (``compute_scale``). With more than one rank the same is timed, in interleaved turns,
    on the whole batch per rank (what a rank computes when the plan replicates a layer over
    tensor-parallel ranks) and on 2 rows (a pipeline's micro-batch), and the points split
    the scale (:func:`split_scale`): ``work_scale`` for the roofline's rate terms, which
    grow with the batch, ``op_scale`` for its fixed per-operator cost. The loss is
    ``loss_fn`` (default: cross-entropy, or the output's sum when ``targets`` is None).
    The model's gradients are cleared and its buffers (e.g. batch-norm statistics)
    restored afterwards. Also returns ``model_step_ms`` (measured), ``model_predicted_ms``
    and, for diagnosis, ``model_step_alone_ms``: rank 0's step while the other ranks wait
    (step / alone ~ how much the ranks slow each other), and ``cores``.

    Example:
        >>> figs = model_compute_scale(model, x, y, cluster)      # doctest: +SKIP
        >>> figs["compute_scale"] > 1                             # doctest: +SKIP
        True
    """
    first = _batched(inputs, "model_compute_scale")
    batch = first.shape[0]
    rows = max(1, batch // dist.get_world_size())
    # the share, then the whole batch (a layer replicated over tensor-parallel ranks) and a
    # micro-batch of 2 rows (a pipeline's), where the per-operator cost shows
    sizes = list(dict.fromkeys((rows, batch, min(rows, 2)))) if rows < batch else [rows]
    with _buffers_kept(model):
        steps: list[Callable[[], object]] = [_step(model, inputs, targets, loss_fn, batch, r)
                                             for r in sizes]
        times = synchronous_times(steps, repeat)
        alone_s = _alone(steps[0], repeat)
        preds = [_predicted_step(model, _share(inputs, batch, r), cluster,
                                 cluster.replace(op_overhead_us=0.0)) for r in sizes]
    model.zero_grad(set_to_none=True)
    step_s, predicted = times[0], preds[0][0]
    out = {"compute_scale": max(1e-3, step_s / predicted), "model_step_ms": step_s * 1e3,
           "model_predicted_ms": predicted * 1e3, "model_step_alone_ms": alone_s * 1e3,
           "cores": _cores(step_s, alone_s, first.device)}
    if len(sizes) > 1:
        out.update(split_scale(*((t, whole - rate, rate) for t, (whole, rate) in
                                 zip(times, preds))))
        out["model_step_whole_batch_ms"] = times[1] * 1e3
        out["model_step_2_rows_ms"] = times[sizes.index(min(rows, 2))] * 1e3
    return out


def _step(model: nn.Module, inputs: Any, targets: Any,
          loss_fn: Callable[[Any, Any], torch.Tensor] | None, batch: int, rows: int
          ) -> Callable[[], None]:
    """Forward + backward of ``model`` on the first ``rows`` samples of the batch."""
    from hexagram.parallel.apply import default_loss

    x, y = _share(inputs, batch, rows), _share(targets, batch, rows)
    loss = loss_fn or (default_loss if targets is not None else _output_sum)
    args = x if isinstance(x, tuple | list) else (x,)

    def step() -> None:
        loss(model(*args), y).backward()
    return step


def _alone(step: Callable[[], object], repeat: int) -> float:
    """Rank 0's step while the other ranks wait (a diagnostic of how much ranks sharing
    cores slow each other), the same on every rank."""
    dist.barrier()
    solo = best_time(step, repeat, "median") if dist.get_rank() == 0 else 0.0
    dist.barrier()
    every: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(every, solo)
    return every[0]


def split_scale(*points: tuple[float, float, float]) -> dict[str, float]:
    """``work_scale`` and ``op_scale`` from measured steps at two or more batch sizes, each
    ``(measured s, predicted per-operator s, predicted rate s)``: ``measured ~ op_scale x
    ops + work_scale x work``, fitted by least squares on relative errors (each point's
    error as a share of its step, so a small batch, where the per-operator cost shows,
    counts as much as a large one; two points are solved exactly). A negative per-operator
    share is taken as 0 (the rate scale alone then fits the points); when the rate does not
    grow, or the largest step measured no slower than the smallest, one scale (the first
    point's ratio) serves both.

    Example:
        >>> split_scale((0.10, 0.02, 0.03), (0.34, 0.02, 0.12))
        {'work_scale': 2.666667, 'op_scale': 1.0}
    """
    m1, o1, w1 = points[0]
    single = {"work_scale": round(m1 / max(o1 + w1, 1e-12), 6)}
    single["op_scale"] = single["work_scale"]
    small, large = min(points, key=lambda p: p[2]), max(points, key=lambda p: p[2])
    if large[2] - small[2] <= 1e-12 or large[0] <= small[0]:
        return single
    a = [o / m for m, o, _ in points]  # per point: o x op + w x work = 1 in relative terms
    b = [w / m for m, _, w in points]
    saa, sab, sbb = (sum(x * y for x, y in zip(u, v)) for u, v in ((a, a), (a, b), (b, b)))
    det = saa * sbb - sab * sab
    if abs(det) <= 1e-18 * max(saa * sbb, 1e-300):
        return single
    op, work = (sbb * sum(a) - sab * sum(b)) / det, (saa * sum(b) - sab * sum(a)) / det
    if op < 0:
        op, work = 0.0, sum(b) / sbb
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
