"""Parity of a given plan (not planned on the ranks) against the single-process model.

:func:`fixed_plan_worker` runs on every rank (``hexagram.launch.run_local``): it builds the
model of a :class:`~hexagram.parallel.verify.ParitySpec`, applies the plan it is handed
(e.g. stages of different ``dp x tp`` shapes assembled from planner outputs), trains
``spec.steps`` steps next to an unsharded copy and returns the largest loss, gradient and
parameter differences. :func:`joined` builds such plans from the planner's own stages.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hexagram.parallel.plans import Plan, StagePlan
from hexagram.parallel.verify import ParitySpec, _diff, _local_elems, _optimizer
from hexagram.parallel.verify import build as _build_known


class Positional(nn.Module):
    """A model whose first stage hands on a tensor that does not scale with the batch
    (``pos``: 4 x hidden, like position embeddings) next to the batch's activations."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.pos = nn.Linear(4, hidden)
        self.inp = nn.Linear(12, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = self.pos(torch.eye(4, dtype=x.dtype, device=x.device))
        h = torch.relu(self.inp(x))
        return self.out(torch.einsum("bh,ph->bp", torch.relu(self.mid(h)), pos))


def build(spec: ParitySpec) -> tuple[nn.Module, Any, Any]:
    """:func:`hexagram.parallel.verify.build`, plus ``model="positional"``."""
    if spec.model != "positional":
        return _build_known(spec)
    torch.manual_seed(spec.seed)
    return (Positional(spec.hidden).to(spec.dtype),
            torch.randn(spec.batch, 12, dtype=spec.dtype), torch.randint(0, 5, (spec.batch,)))


def joined(stages: list[StagePlan], like: Plan, **changes: Any) -> Plan:
    """A plan with ``stages`` renumbered onto consecutive ranks, the rest from ``like``."""
    out, first = [], 0
    for st in stages:
        n = st.dp * st.tp
        out.append(dataclasses.replace(st, ranks=list(range(first, first + n))))
        first += n
    return dataclasses.replace(like, stages=out, **changes)


def zero(stage: StagePlan) -> StagePlan:
    """The stage with every linear's parameters ZeRO-sharded over its dp ranks."""
    return dataclasses.replace(stage, shardings={
        k: v if v.endswith("+zero") else v + "+zero" for k, v in stage.shardings.items()})


def fixed_plan_worker(spec: ParitySpec, plan_json: str, zero_stage: int = 3
                      ) -> dict[str, Any]:
    """Train ``spec.steps`` steps under the plan and unsharded; return the gaps."""
    import hexagram as hx
    from hexagram.parallel.apply import default_loss, parallelize

    hx.init()
    model, x, y = build(spec)
    ref = build(spec)[0]
    ref.load_state_dict(model.state_dict())
    pm = parallelize(model, Plan.from_json(plan_json), zero_stage=zero_stage,
                     example_inputs=x)
    opt, ref_opt = _optimizer(spec, pm.parameters()), _optimizer(spec, ref.parameters())
    ref_params = dict(ref.named_parameters())
    out: dict[str, Any] = {"grad_diff": 0.0, "loss_diff": 0.0, "losses": [],
                           "stage": pm.stage_index, "local_params": _local_elems(pm.module),
                           "stage_params": sum(q.numel() for q in pm.module.parameters())}
    for step in range(spec.steps):
        xs, ys = (x, y) if step == 0 else build(dataclasses.replace(
            spec, seed=spec.seed + step))[1:]
        loss = pm.train_step(xs, ys)
        ref_loss = default_loss(ref(xs), ys)
        ref_loss.backward()
        grads = pm.full_gradients()
        out["grad_diff"] = max(out["grad_diff"], _diff(
            grads, {n: ref_params[n].grad for n in grads}))
        if loss is not None:
            out["loss_diff"] = max(out["loss_diff"], abs(loss - ref_loss.item()))
        out["losses"].append(loss)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = pm.full_parameters()
    out["param_diff"] = _diff(full, {n: ref_params[n].detach() for n in full})
    dist.barrier()
    out["cpu_s"] = time.process_time()  # this rank's CPU seconds so far (import included)
    return out


def many(jobs: list[tuple[ParitySpec, str, int]]) -> list[dict[str, Any]]:
    """Several :func:`fixed_plan_worker` runs in one launch (the ranks start once)."""
    return [fixed_plan_worker(*job) for job in jobs]
