"""Real ZeRO for planned stages: FSDP2 (``fully_shard``) over the stage's data-parallel mesh.

Every module a :class:`~hexagram.parallel.plans.StagePlan` marks ``+zero`` becomes one FSDP2
unit on the stage's ``dp`` mesh: its parameters are ``Shard(0)`` DTensors over ``dp`` (on
top of any tensor-parallel layout), so gradients and the optimizer state built from them are
``1/dp`` shards. Parameters are all-gathered before forward and again before backward and
gradients reduce-scattered and averaged, which is what the cost model prices for ZeRO-3.
The units share one communication context (``share_comm_ctx``): otherwise every unit, being
its own FSDP root, keeps its full-size reduce-scatter buffer until backward ends.

On gloo, the reduce-scatter is done as an in-place allreduce of FSDP's own flat buffer
followed by a copy of this rank's slice (:class:`InPlaceReduceScatter`): gloo's
``reduce_scatter_single`` clones the whole input inside the call (an extra full-size
buffer per unit, measured with :mod:`hexagram.parallel.memory`).

Example:
    >>> apply_zero(stage_module, stage, mesh["dp"])               # doctest: +SKIP
    ['1.fc1', '1.fc2']
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, share_comm_ctx

# the interface FSDPModule.set_custom_reduce_scatter accepts (not re-exported publicly)
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from hexagram.errors import HexagramError
from hexagram.parallel.plans import StagePlan

__all__ = ["InPlaceReduceScatter", "apply_zero", "fsdp_managed"]


class InPlaceReduceScatter(ReduceScatter):
    """Reduce-scatter as allreduce (in place, on FSDP's temporary buffer) + own slice.

    Same bytes on the wire as gloo's own reduce-scatter of a flat tensor, no extra copy.
    """

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: object, async_op: bool = False) -> None:
        avg = op == dist.ReduceOp.AVG
        dist.all_reduce(input_tensor, op=dist.ReduceOp.SUM if avg else op,  # type: ignore[arg-type]
                        group=group)
        n = dist.get_world_size(group)
        mine = input_tensor.view(n, -1)[dist.get_rank(group)]
        output_tensor.copy_(mine / n if avg else mine)


def apply_zero(module: nn.Module, stage: StagePlan, dp_mesh: DeviceMesh,
               zero_stage: int = 3) -> list[str]:
    """Shard the modules the plan marks ``+zero`` over ``dp_mesh`` with FSDP2.

    Each such module (path in the plan, e.g. ``"1.fc1"``, relative to ``module``) gets its
    own ``fully_shard`` unit. ``zero_stage``: 3 re-shards parameters after forward (gathered
    again for backward; the cost model's ZeRO-3), 2 keeps them gathered until backward is
    done (less traffic, more memory). FSDP2 has no optimizer-state-only mode (ZeRO-1).
    Returns the sharded paths (none when ``dp == 1``).
    """
    if zero_stage not in (2, 3):
        raise HexagramError(f"zero_stage must be 2 or 3 (FSDP2 has no ZeRO-1 mode: "
                            f"optimizer-state-only sharding), got {zero_stage}")
    if stage.dp == 1:
        return []
    gloo = "gloo" in str(dist.get_backend(dp_mesh.get_group())).lower()
    paths = [path for path, kind in stage.shardings.items() if kind.endswith("+zero")]
    units = []
    for path in paths:
        unit = fully_shard(module.get_submodule(path), mesh=dp_mesh,
                           reshard_after_forward=zero_stage == 3)
        if gloo:
            unit.set_custom_reduce_scatter(InPlaceReduceScatter())
        units.append(unit)
    # one communication context: each unit is its own FSDP root, and a root keeps its last
    # reduce-scatter buffer until backward ends; shared, a unit frees its predecessor's
    share_comm_ctx(units)
    return paths


def fsdp_managed(module: nn.Module) -> set[int]:
    """ids of the parameters FSDP2 shards (it reduce-scatters and averages their grads)."""
    return {id(p) for m in module.modules() if isinstance(m, FSDPModule)
            for p in m.parameters()}
