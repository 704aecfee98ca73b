"""Run a :class:`~hexagram.parallel.plans.Plan` on PyTorch's own engine, step by step.

- :func:`apply_stage`: this rank's part of the model (names kept): a slice of an
  ``nn.Sequential``, or the stage's graph of any fx-traceable model.
- :func:`apply_sharding`: ``parallelize_module`` with Colwise/Rowwise styles on the stage's
  ``tp`` mesh (DTensor does the plan's reshardings at the linears' edges).
- :func:`apply_pipeline`: a ``torch.distributed.pipelining`` stage and a GPipe / 1F1B schedule
  when every stage has the same ``dp x tp`` shape; otherwise a
  :class:`~hexagram.parallel.hetero.CrossMeshPipeline` (GPipe or 1F1B) that links stage meshes
  of any shapes by cross-mesh resharding of activations and their gradients.
- :func:`apply_zero`: real ZeRO: every module the plan marks ``+zero`` is sharded over the
  stage's ``dp`` mesh with FSDP2 (``fully_shard``): parameters, gradients and optimizer
  state live as ``1/dp`` shards; parameters are all-gathered for forward and backward and
  gradients reduce-scattered (ZeRO-3, as the cost model prices it; ``zero_stage=2`` keeps
  parameters unsharded between forward and backward).
- :func:`sync_gradients`: average the other gradients over the stage's ``dp`` ranks.

Every rank calls :func:`parallelize` (process groups are created collectively).

Example:
    >>> dist_model = parallelize(model, plan)                    # doctest: +SKIP
    >>> loss = dist_model.train_step(inputs, targets)            # doctest: +SKIP
    >>> optimizer.step()                                         # doctest: +SKIP
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)

from hexagram.comm.device import group_device
from hexagram.errors import ConfigError, HexagramError
from hexagram.parallel.dpsync import allreduce_mean
from hexagram.parallel.hetero import CrossMeshPipeline
from hexagram.parallel.plans import Plan, StagePlan
from hexagram.parallel.runner import ParallelModel
from hexagram.parallel.split import boundaries, split_stages
from hexagram.parallel.zero import apply_zero, fsdp_managed
from hexagram.runtime import get_runtime, is_initialized

__all__ = ["apply_pipeline", "apply_sharding", "apply_stage", "apply_zero", "check_backend",
           "check_executable", "default_loss", "dtensor_parts", "is_heterogeneous",
           "parallelize", "sync_gradients"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the last dimension (``[..., C]`` logits, ``[...]`` labels)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def is_heterogeneous(plan: Plan) -> bool:
    """Stages of different ``dp x tp`` shapes (linked by cross-mesh resharding)."""
    return len({(s.dp, s.tp) for s in plan.stages}) > 1


def check_executable(model: nn.Module, plan: Plan, world_size: int,
                     example_inputs: Any = None) -> None:
    """Clear errors for plans this executor cannot run on this model and job."""
    n_layers = plan.stages[-1].layers[1]
    if not isinstance(model, nn.Sequential):
        if len(plan.stages) > 1 and example_inputs is None:
            raise HexagramError(f"{type(model).__name__} is not an nn.Sequential: splitting it "
                                f"into {len(plan.stages)} pipeline stages traces it, so pass "
                                f"parallelize(model, plan, example_inputs=...)")
    elif len(model) != n_layers:
        raise HexagramError(f"the plan covers {n_layers} layers but the model has "
                            f"{len(model)} children: plan the same model")
    if plan.devices != world_size:
        raise HexagramError(f"the plan is for {plan.devices} devices but {world_size} ranks "
                            f"run: launch with torchrun --nproc-per-node {plan.devices}")
    if is_heterogeneous(plan) and example_inputs is None:
        raise HexagramError("the plan's stages have different dp x tp shapes: linking them "
                            "traces the model to find the tensors crossing each stage "
                            "boundary, so pass parallelize(model, plan, example_inputs=...)")
    if plan.blockers:
        raise HexagramError("the plan reshards between non-linear operators, which this "
                            f"executor cannot place: {plan.blockers[:3]}")


def dtensor_parts(plan: Plan) -> list[str]:
    """What of ``plan`` runs on DTensor or FSDP2: ``"stage K: tensor parallel (tp=T)"``
    for a stage with ``tp > 1``, ``"stage K: ZeRO (FSDP2) of PATH"`` for a module marked
    ``+zero`` in a stage with ``dp > 1`` (what :func:`apply_sharding` and
    :func:`apply_zero` would build); empty for plain pipeline and data parallelism."""
    parts = []
    for k, st in enumerate(plan.stages):
        if st.tp > 1:
            parts.append(f"stage {k}: tensor parallel (tp={st.tp})")
        zero = [p for p, kind in st.shardings.items() if kind.endswith("+zero")]
        if st.dp > 1 and zero:
            parts.append(f"stage {k}: ZeRO (FSDP2) of {zero[0]!r}")
    return parts


def check_backend(plan: Plan, device_type: str, backend: str) -> None:
    """Refuse a DTensor/FSDP2 plan on CUDA tensors over gloo, before anything is built.

    There the coalesced all-gather of DTensor and FSDP2 crashes every rank (SIGSEGV, no
    Python error), so the plan is refused with the fix instead: NCCL. The CPU over gloo
    and CUDA over NCCL run every plan; so does CUDA over gloo without tensor parallelism
    or ZeRO (pipeline stages and data parallelism use plain collectives).

    Example:
        >>> from hexagram.parallel.cluster import Cluster
        >>> st = StagePlan(layers=(0, 1), ranks=[0, 1], dp=1, tp=2, latency_s=0.0,
        ...                memory_bytes=0.0)
        >>> plan = Plan(cluster=Cluster(hosts=1, devices_per_host=2), stages=[st],
        ...             microbatches=1, global_batch=2, step_time_s=0.0)
        >>> check_backend(plan, "cpu", "gloo")      # fine: the CPU
        >>> check_backend(plan, "cuda", "gloo")     # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        hexagram.errors.ConfigError: ...
    """
    if device_type != "cuda" or "gloo" not in backend.lower():
        return
    parts = dtensor_parts(plan)
    if parts:
        raise ConfigError(
            f"this plan runs DTensor/FSDP2 ({'; '.join(parts)}) on CUDA tensors over gloo, "
            "whose coalesced all-gather crashes every rank there (SIGSEGV): run it over "
            "NCCL (hexagram.init(backend='nccl'), the default with CUDA), or plan it for "
            "the CPU, or without tensor parallelism and ZeRO")


def apply_stage(model: nn.Module, stage: StagePlan, plan: Plan | None = None,
                example_inputs: Any = None) -> nn.Module:
    """The stage's part of ``model``, keeping the model's parameter names: a slice of an
    ``nn.Sequential``; the model itself for a one-stage plan; else the stage's fx graph
    (:func:`~hexagram.parallel.split.split_stages`, needs ``plan`` and ``example_inputs``)."""
    if isinstance(model, nn.Sequential):
        start, end = stage.layers
        return nn.Sequential(OrderedDict((str(k), model[k]) for k in range(start, end)))
    if plan is None or len(plan.stages) == 1:
        return model
    return split_stages(model, example_inputs, plan)[plan.stages.index(stage)]


def _layout(code: str) -> Shard | Replicate:
    return Shard(-1) if code == "S" else Replicate()


def _style(kind: str, given: str, handed: str) -> ParallelStyle | None:
    """The ParallelStyle of one linear: receive ``given``, hand on ``handed``."""
    base = kind.split("+")[0]
    if base == "colwise":
        return ColwiseParallel(input_layouts=_layout(given), output_layouts=_layout(handed))
    if base == "rowwise":
        return RowwiseParallel(input_layouts=_layout(given), output_layouts=_layout(handed))
    if given == "S" and handed == "S":
        raise HexagramError("a replicated linear between sharded tensors is not executable")
    if given == "S":
        # a plain local tensor for the replicated linear's plain parameters (a DTensor
        # input would meet them in addmm: "got mixed torch.Tensor and DTensor")
        return PrepareModuleInput(input_layouts=(Shard(-1),), desired_input_layouts=(
            Replicate(),), use_local_output=True)
    if handed == "S":
        return PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(
            Shard(-1),))
    return None


def apply_sharding(module: nn.Module, stage: StagePlan, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard the stage's linears over ``tp_mesh`` as the plan says (no-op when tp == 1)."""
    if stage.tp == 1:
        return module
    styles = {}
    for path, kind in stage.shardings.items():
        given, handed = stage.layouts.get(path, ("R", "R"))
        style = _style(kind, given, handed)
        if style is not None:
            styles[path] = style
    return parallelize_module(module, tp_mesh, styles)


def apply_pipeline(module: nn.Module, plan: Plan, index: int, group: dist.ProcessGroup,
                   loss_fn: LossFn, device: torch.device | None = None
                   ) -> ScheduleGPipe | Schedule1F1B:
    """A pipeline stage over ``group`` (one rank per stage) and the plan's schedule;
    ``device``: where the stage runs (default: the group's, see :mod:`hexagram.comm.device`)."""
    device = device if device is not None else group_device(group)
    stage = PipelineStage(module, index, len(plan.stages), device, group=group)
    schedule = Schedule1F1B if plan.schedule == "1f1b" else ScheduleGPipe
    return schedule(stage, n_microbatches=plan.microbatches, loss_fn=loss_fn)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def sync_gradients(module: nn.Module, stage: StagePlan, group: dist.ProcessGroup) -> None:
    """Average gradients over the stage's data-parallel ranks (``group``), one allreduce per
    bucket of :data:`~hexagram.parallel.plans.DP_BUCKET_BYTES` (not one per tensor: each
    collective pays the link latency); parameters sharded by :func:`apply_zero` are skipped
    (FSDP2 already reduce-scattered them). A stage whose ``dp_algorithm`` is not
    ``"allreduce"`` is synchronised by that algorithm
    (:func:`hexagram.parallel.relax.algorithm_sync`)."""
    if stage.dp == 1:
        return
    if stage.dp_algorithm != "allreduce":  # a relaxation: the stage's Hexagram algorithm
        from hexagram.parallel.relax import algorithm_sync
        return algorithm_sync(module, stage, group)
    managed = fsdp_managed(module)
    grads = [_local(p.grad) for p in module.parameters()
             if p.grad is not None and id(p) not in managed]
    allreduce_mean(grads, group, stage.dp)  # module order: the same on every rank


def _groups(plan: Plan, rank: int, device: torch.device
            ) -> tuple[int, DeviceMesh, dist.ProcessGroup | None]:
    """(my stage, my stage's dp x tp mesh, my pipeline group: None for one stage or for
    stages of different shapes); collective on all ranks."""
    mine, my_mesh, my_pp = -1, None, None
    for k, st in enumerate(plan.stages):
        mesh = DeviceMesh(device.type, torch.tensor(st.ranks).view(st.dp, st.tp),
                          mesh_dim_names=("dp", "tp"))
        if rank in st.ranks:
            mine, my_mesh = k, mesh
    pipelines = 0 if is_heterogeneous(plan) else len(plan.stages[0].ranks)
    for local in range(pipelines):
        ranks = [st.ranks[local] for st in plan.stages]
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            my_pp = group
    assert my_mesh is not None
    return mine, my_mesh, my_pp


def parallelize(model: nn.Module, plan: Plan, loss_fn: LossFn = default_loss,
                zero_stage: int = 3, example_inputs: Any = None) -> ParallelModel:
    """Apply ``plan`` to ``model`` on this rank (all ranks call it with the same plan).

    ``model``: any module torch.fx traces (an ``nn.Sequential`` is sliced by children;
    other models are split into stages by tracing on ``example_inputs``, which may be on
    ``"meta"``). ``zero_stage`` (3 or 2): how :func:`apply_zero` shards ``+zero`` modules.
    Returns a :class:`~hexagram.parallel.runner.ParallelModel` whose ``train_step(inputs,
    targets)`` runs forward and backward of one global batch and averages gradients.
    """
    if not dist.is_initialized():
        raise HexagramError("parallelize runs on the ranks torchrun started: call "
                            "hexagram.init() first")
    rank = dist.get_rank()
    check_executable(model, plan, dist.get_world_size(), example_inputs)
    device = get_runtime().device if is_initialized() else group_device(None)
    check_backend(plan, device.type, str(dist.get_backend()))
    index, mesh, pp_group = _groups(plan, rank, device)
    stage = plan.stages[index]
    # traced before the model's modules are sharded in place (fx cannot trace DTensors)
    bounds = boundaries(model, example_inputs, plan) if is_heterogeneous(plan) else []
    part = apply_stage(model, stage, plan, example_inputs).to(device)
    module = apply_sharding(part, stage, mesh["tp"])
    apply_zero(module, stage, mesh["dp"], zero_stage)
    schedule: Any = None
    if is_heterogeneous(plan):
        if isinstance(model, nn.Sequential) and any(len(b) != 1 for b in bounds):
            raise HexagramError(f"an nn.Sequential stage hands on one tensor, but the traced "
                                f"model passes {[len(b) for b in bounds]} across its stage "
                                f"boundaries: wrap it in a plain nn.Module")
        schedule = CrossMeshPipeline(module, plan, index, bounds, loss_fn, device)
    elif pp_group is not None:
        schedule = apply_pipeline(module, plan, index, pp_group, loss_fn, device)
    dp_rank = stage.ranks.index(rank) // stage.tp
    return ParallelModel(module=module, plan=plan, stage_index=index, dp_rank=dp_rank,
                         dp_group=mesh.get_group("dp"), schedule=schedule, loss_fn=loss_fn,
                         sync=sync_gradients, device=device)
