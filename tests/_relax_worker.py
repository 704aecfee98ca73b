"""Rank worker of tests/test_parallel_relax.py: a planned model whose stages synchronise
their gradients by a Hexagram algorithm, against the existing path or hexagram's DDP."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hexagram.parallel.cluster import Cluster
from hexagram.parallel.plans import Plan
from hexagram.parallel.verify import ParitySpec, _plan, build


@dataclass(frozen=True, kw_only=True)
class RelaxSpec:
    """``compare``: ``"path"`` (same plan, existing allreduce sync), ``"ddp"`` (hexagram's
    DistributedDataParallel with the same algorithm; one-stage plans with dp == world) or
    ``"none"`` (report losses and whether dp replicas agree)."""

    parity: ParitySpec
    algorithm: str = "allreduce"
    options: dict[str, Any] = field(default_factory=dict)
    compare: str = "path"


def _with_sync(plan: Plan, algorithm: str, options: dict[str, Any]) -> Plan:
    stages = [dataclasses.replace(s, dp_algorithm=algorithm, dp_options=dict(options))
              for s in plan.stages]
    return dataclasses.replace(plan, stages=stages)


def _batch(spec: ParitySpec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, x, y = build(dataclasses.replace(spec, seed=spec.seed + step))
    return x, y


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _replicas_agree(pm: Any) -> float:
    """Largest difference of this stage's parameters across its dp replicas."""
    full = pm.full_parameters()
    flat = torch.cat([t.reshape(-1) for _, t in sorted(full.items())])
    other = flat.clone()
    dist.broadcast(other, group=pm.dp_group, group_src=0)
    return (flat - other).abs().max().item()


def relax_worker(spec: RelaxSpec) -> dict[str, Any]:
    import hexagram as hx
    from hexagram.parallel.apply import parallelize
    from hexagram.parallel.relax import algorithm_sync, stage_sync

    hx.init()
    ps = spec.parity
    model, x, _ = build(ps)
    twin = build(ps)[0]
    twin.load_state_dict(model.state_dict())
    plan = _plan(model, x, ps)
    pm = parallelize(model, _with_sync(plan, spec.algorithm, spec.options), example_inputs=x)
    pm.sync = algorithm_sync  # also for "allreduce", which sync_gradients keeps for itself
    ref: Any = None
    if spec.compare == "path":
        ref = parallelize(twin, plan, example_inputs=x)
    elif spec.compare == "ddp":
        algo = hx.algorithms.get(spec.algorithm, **spec.options)
        ref = hx.DistributedDataParallel(twin, algorithm=algo)
    opt = torch.optim.SGD(pm.parameters(), lr=ps.lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=ps.lr) if ref is not None else None
    out: dict[str, Any] = {"losses": [], "loss_diff": 0.0, "grad_diff": 0.0,
                           "plan": pm.plan.to_json(indent=None)}
    for step in range(ps.steps):
        xs, ys = _batch(ps, step)
        loss = pm.train_step(xs, ys)
        out["losses"].append(loss)
        if spec.compare == "path":
            ref_loss = ref.train_step(xs, ys)
            if loss is not None:
                out["loss_diff"] = max(out["loss_diff"], abs(loss - ref_loss))
            out["grad_diff"] = max(out["grad_diff"], _max_diff(pm.full_gradients(),
                                                               ref.full_gradients()))
        elif spec.compare == "ddp":
            per = xs.shape[0] // dist.get_world_size()
            mine = slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)
            from hexagram.parallel.apply import default_loss
            default_loss(ref(xs[mine]), ys[mine]).backward()
            grads = pm.full_gradients()
            named = dict(ref.module.named_parameters())
            out["grad_diff"] = max(out["grad_diff"], _max_diff(
                grads, {n: named[n].grad for n in grads}))
        for o in (opt, ref_opt):
            if o is not None:
                o.step()
                o.zero_grad()
    if spec.compare == "path":
        out["param_diff"] = _max_diff(pm.full_parameters(), ref.full_parameters())
    out["replica_diff"] = _replicas_agree(pm)
    sync = stage_sync(pm.module)
    out["bytes_sent"] = sync.bytes_sent() if sync is not None else 0
    return out


def cluster(world: int, **fields: Any) -> Cluster:
    return Cluster(hosts=1, devices_per_host=world, dtype_bytes=8, **fields)
