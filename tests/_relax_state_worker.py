"""Rank worker of tests/test_parallel_relax_state.py: a dp=2 plan whose stage syncs by
PowerSGD, trained without a break (saving a checkpoint midway) or resumed from that
checkpoint in a fresh process group."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hexagram.parallel.plans import Plan
from hexagram.parallel.verify import ParitySpec, _plan, build


@dataclass(frozen=True, kw_only=True)
class StateSpec:
    """``mode``: ``"full"`` (steps 0..steps-1, checkpoint after ``save_at`` steps) or
    ``"resume"`` (load the checkpoint, steps save_at..steps-1)."""

    parity: ParitySpec
    options: dict[str, Any] = field(default_factory=dict)
    save_at: int = 4
    mode: str = "full"
    folder: str = ""


def _flat(pm: Any) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for _, t in sorted(pm.full_parameters().items())])


def _setup(spec: StateSpec, plan: Plan | None = None, **options: Any) -> tuple[Any, Any]:
    """A fresh planned model (same seed: same weights) and its SGD-with-momentum optimizer."""
    from hexagram.parallel.apply import parallelize

    ps = spec.parity
    model, x, _ = build(ps)
    if plan is None:
        plan = _plan(model, x, ps)
        opts = {**spec.options, **options}
        plan = dataclasses.replace(plan, stages=[dataclasses.replace(
            s, dp_algorithm="powersgd", dp_options=opts) for s in plan.stages])
    pm = parallelize(model, plan, example_inputs=x)
    return pm, torch.optim.SGD(pm.parameters(), lr=ps.lr, momentum=0.9)


def _train(spec: StateSpec, pm: Any, opt: Any, steps: range) -> tuple[list, list]:
    losses, params = [], []
    for step in steps:
        _, xs, ys = build(dataclasses.replace(spec.parity, seed=spec.parity.seed + step))
        losses.append(pm.train_step(xs, ys))
        opt.step()
        opt.zero_grad()
        params.append(_flat(pm))
        if spec.mode == "full" and step + 1 == spec.save_at:
            torch.save({"plan": pm.plan.to_json(), "module": pm.module.state_dict(),
                        "opt": opt.state_dict(), "algo": pm.algorithm_state_dict()},
                       Path(spec.folder) / f"rank{dist.get_rank()}.pt")
    return losses, params


def _refusal(action: Any) -> str:
    try:
        action()
    except Exception as e:  # the test checks type and message
        return f"{type(e).__name__}: {e}"
    return "accepted"


def state_worker(spec: StateSpec) -> dict[str, Any]:
    import hexagram as hx

    hx.init()
    rank = dist.get_rank()
    if spec.mode == "full":
        pm, opt = _setup(spec)
        losses, params = _train(spec, pm, opt, range(spec.parity.steps))
        return {"losses": losses, "params": params}
    folder = Path(spec.folder)
    saved = torch.load(folder / f"rank{rank}.pt", weights_only=True)
    plan = Plan.from_json(saved["plan"])
    out: dict[str, Any] = {"state_keys": sorted(saved["algo"]["sync"]["state"] or {})}
    for name, with_algo in (("resumed", True), ("without_algo", False)):
        pm, opt = _setup(spec, plan)
        pm.module.load_state_dict(saved["module"])
        opt.load_state_dict(saved["opt"])
        if with_algo:
            pm.load_algorithm_state_dict(saved["algo"])
        out[name] = _train(spec, pm, opt, range(spec.save_at, spec.parity.steps))
    other = torch.load(folder / f"rank{1 - rank}.pt", weights_only=True)["algo"]
    pm, _ = _setup(spec, plan)
    out["other_rank"] = _refusal(lambda: pm.load_algorithm_state_dict(other))
    pm4, _ = _setup(spec, None, rank=4)
    out["other_config"] = _refusal(lambda: pm4.load_algorithm_state_dict(saved["algo"]))
    out["not_a_state"] = _refusal(lambda: pm.load_algorithm_state_dict(saved["module"]))
    return out
