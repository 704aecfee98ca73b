"""Any model torch.fx captures executes under the planner's plans (not only nn.Sequential).

A plain module with residual connections (a long skip crosses the pipeline boundary), the
reference GPT (hexagram.models.gpt.GPT, whose forward checks the sequence length in Python)
and the reference CNN, planned on 2 gloo ranks under pipeline, tensor- and data-parallel
constraints, match the single-process model over 5 SGD steps in float64 (1e-6).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from hexagram.launch import run_local
from hexagram.parallel import Cluster, plan
from hexagram.parallel.models import ResidualMLP
from hexagram.parallel.split import split_stages
from hexagram.parallel.trace import UntraceableModelError
from hexagram.parallel.verify import ParitySpec, parity_worker

TOL = 1e-6


def _compute_bound(world: int) -> Cluster:
    return Cluster(hosts=1, devices_per_host=world, device_tflops=1e-6, dtype_bytes=8,
                   op_overhead_us=0.0)


def _many(specs: list[ParitySpec]) -> list[dict[str, Any]]:
    """All parity runs in one launch (ranks start once)."""
    return [parity_worker(s) for s in specs]


def test_split_stages_chain_to_the_model_forward() -> None:
    torch.manual_seed(0)
    model = ResidualMLP(12, 16, 5, blocks=3).double()
    x = torch.randn(4, 12, dtype=torch.float64)
    from hexagram.parallel import Constraints
    p = plan(model, x, Cluster(hosts=1, devices_per_host=4, dtype_bytes=8),
             Constraints(pp=4, schedule="gpipe", microbatches=2))
    stages = split_stages(model, x, p)
    assert len(stages) == 4
    handed: Any = (x,)
    for k, st in enumerate(stages):
        handed = st(*handed)
        if k == 1:  # the long skip from stage 0 passes through the middle stage
            assert isinstance(handed, tuple) and len(handed) >= 2
    torch.testing.assert_close(handed, model(x), rtol=0, atol=0)
    names = {n for st in stages for n, _ in st.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(int(x.sum())):  # a loop count read from the data
            x = self.fc(x)
        return x


def test_untraceable_model_names_the_operation_and_the_way_out() -> None:
    with pytest.raises(UntraceableModelError) as err:
        plan(_DataDependent(), torch.ones(2, 4), Cluster(hosts=1, devices_per_host=2))
    text = str(err.value)
    assert "_DataDependent" in text and "int(x.sum())" in text and "leaf_modules" in text


@pytest.mark.timeout(420)
def test_non_sequential_models_match_single_process_under_plans() -> None:
    pipe = {"pp": 2, "microbatches": 2}
    specs = [
        ParitySpec(model="residual", layers=2, hidden=16, constraints={**pipe,
                                                                     "schedule": "gpipe"}),
        ParitySpec(model="residual", layers=2, hidden=16, constraints={"tp": 2},
                   cluster=_compute_bound(2)),
        ParitySpec(model="refgpt", layers=2, hidden=16, constraints=pipe),
        ParitySpec(model="refgpt", layers=2, hidden=16, constraints={"dp": 2}),
        ParitySpec(model="cnn", hidden=16, constraints=pipe),
    ]
    ranks = run_local(_many, 2, args=(specs,), timeout=400)
    for k, spec in enumerate(specs):
        rows = [r[k] for r in ranks]
        for r in rows:
            assert r["grad_diff"] < TOL and r["param_diff"] < TOL and r["loss_diff"] < TOL, \
                (spec.model, spec.constraints)
        stages = json.loads(rows[0]["plan"])["stages"]
        if "pp" in spec.constraints:
            assert len(stages) == 2 and {r["stage"] for r in rows} == {0, 1}
        if "tp" in spec.constraints:
            assert "colwise" in stages[0]["shardings"].values()
