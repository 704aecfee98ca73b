"""A ``torch.amp.GradScaler`` without fp16 autocast skips on every rank or on none.

bf16 and fp32 users may scale their loss with a GradScaler and no fp16 autocast. Before,
the engine shared its non-finite flag only under fp16 autocast, so an Inf on one of two
ranks made that rank's scaler skip while the other stepped (fp16, powersgd, topk, qsgd,
efsign; allreduce agreed: its sum carries the Inf). Now the flag is always shared: 2 gloo
ranks, an Inf injected into rank 0's input at step 2: both ranks skip step 2 and only it,
their scales stay equal, and their parameters are equal bit for bit afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hexagram.launch import run_local

ALGORITHMS: dict[str, dict[str, Any]] = {
    "fp16": {}, "powersgd": {"start_iter": 0}, "topk": {"density": 0.1}, "qsgd": {},
    "efsign": {}, "allreduce": {}}
BAD_STEP, STEPS = 2, 4


def _run(name: str, config: dict[str, Any]) -> dict[str, Any]:
    import hexagram as hx

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(name, **config))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    rank = hx.get_runtime().rank
    gen = torch.Generator().manual_seed(rank)
    stepped, scales = [], []
    for step in range(STEPS):
        x = torch.randn(8, 20, generator=gen)
        if step == BAD_STEP and rank == 0:
            x[0, 0] = float("inf")
        scaler.scale(model(x).square().mean()).backward()
        before = [p.detach().clone() for p in net.parameters()]
        scaler.step(opt)
        scaler.update()
        stepped.append(any(not torch.equal(b, p) for b, p in zip(before, net.parameters())))
        scales.append(scaler.get_scale())
        opt.zero_grad()
    params = [p.detach().clone() for p in net.parameters()]
    model.close()
    return {"stepped": stepped, "scales": scales, "params": params}


def _worker() -> dict[str, Any]:
    import hexagram as hx

    hx.init()
    return {name: _run(name, config) for name, config in ALGORITHMS.items()}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_local(_worker, 2, timeout=240)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_rank_skips_the_same_step(name: str, runs: list[dict[str, Any]]) -> None:
    a, b = runs[0][name], runs[1][name]
    expected = [step != BAD_STEP for step in range(STEPS)]
    assert a["stepped"] == b["stepped"] == expected, (a["stepped"], b["stepped"])
    assert a["scales"] == b["scales"] and a["scales"][BAD_STEP] == 2.0 ** 9, \
        (a["scales"], b["scales"])
    for pa, pb in zip(a["params"], b["params"]):
        assert torch.equal(pa, pb)
        assert torch.isfinite(pa).all()
