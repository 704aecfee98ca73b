"""``hp.auto``: one call measures the running job, plans, applies; bad world sizes are named."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hexagram.errors import HexagramError
from hexagram.launch import run_local
from hexagram.parallel import Cluster, Constraints, plan
from hexagram.parallel.apply import check_executable, default_loss
from hexagram.parallel.models import ResidualMLP


def _model_and_batch() -> tuple[ResidualMLP, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = ResidualMLP(12, 16, 5, blocks=2).double()
    return model, torch.randn(8, 12, dtype=torch.float64), torch.randint(0, 5, (8,))


def test_plan_for_another_world_size_names_both() -> None:
    model, x, _ = _model_and_batch()
    p = plan(model, x, Cluster(hosts=1, devices_per_host=2, dtype_bytes=8),
             Constraints(dp=2))
    with pytest.raises(HexagramError, match="plan is for 2 devices but 4 ranks run"):
        check_executable(model, p, world_size=4)


def _auto_worker() -> dict[str, Any]:
    import hexagram.parallel as hp

    model, x, y = _model_and_batch()
    ref = _model_and_batch()[0]
    pm = hp.auto(model, x)
    loss = pm.train_step(x, y)
    try:
        hp.auto(_model_and_batch()[0], x, cluster=Cluster(hosts=1, devices_per_host=4))
        wrong = ""
    except HexagramError as exc:
        wrong = str(exc)
    return {"report": pm.report, "loss": loss, "ref": default_loss(ref(x), y).item(),
            "devices": pm.plan.devices, "wrong": wrong}


@pytest.mark.timeout(300)
def test_auto_measures_plans_and_runs_on_two_ranks() -> None:
    results = run_local(_auto_worker, 2, timeout=280)
    for r in results:
        assert r["devices"] == 2 and "Plan for 1x2 devices" in r["report"]
        assert "measured cluster" in r["report"] and "Gbit/s" in r["report"]
        assert "4 devices but this job runs 2 ranks" in r["wrong"]
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses and all(abs(v - results[0]["ref"]) < 1e-6 for v in losses)
