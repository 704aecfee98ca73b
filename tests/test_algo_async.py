"""Asynchronous model averaging: no lost update, abort/resume, uneven ends, clean shutdown.

Each rank applies a known, rank-specific update per step (SGD on a linear loss, so the
gradient is a constant) a different number of times while the background thread averages.
Averaging never changes the sum of the ranks' weights, so after ``synchronize()`` every rank
must hold exactly ``x0 - lr * sum_i(steps_i * c_i) / P``: any overwritten (lost) local step
or half-applied round would show up in that equality.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from hexagram.algorithms import registry
from hexagram.errors import ConfigError
from hexagram.launch import run_local

LR = 0.1


def _constant(rank: int) -> torch.Tensor:
    return torch.tensor([[1.0 + rank, -2.0 * rank, 0.5]])


def _worker() -> dict[str, float]:
    import torch.distributed as dist

    import hexagram as hx

    rt = hx.init()
    torch.manual_seed(0)
    net = nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get("async", interval_ms=2.0))
    algo: Any = model.algorithm
    x0 = net.weight.detach().clone()
    steps = 30 + 10 * rt.rank  # uneven: ranks finish at different times
    c = _constant(rt.rank)
    rounds: dict[str, float] = {}
    for s in range(steps):
        if s == 10:
            # background rounds run on their own clock: on a loaded machine 10 steps may
            # pass before the first; give it up to 10 s (a broken thread never gets one)
            deadline = time.monotonic() + 10.0
            while algo.rounds < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            rounds["before_abort"] = algo.rounds
            algo.abort()
            rounds["at_abort"] = algo.rounds
        if s == 15:
            rounds["at_resume"] = algo.rounds
            algo.resume()
        model(c).sum().backward()  # d/dw (w . c) = c
        opt.step()
        opt.zero_grad()
        time.sleep(0.004)
    model.synchronize()
    total = torch.zeros(1, 3)
    for r in range(rt.world_size):
        total += (30 + 10 * r) * _constant(r)
    expected = x0 - LR * total / rt.world_size
    weight = net.weight.detach().clone()
    gathered = [torch.empty_like(weight) for _ in range(rt.world_size)]
    dist.all_gather(gathered, weight)
    model.close()
    return {"error": (weight - expected).abs().max().item(),
            "spread": max((g - weight).abs().max().item() for g in gathered),
            "rounds": float(algo.rounds),
            "rounds_while_aborted": rounds["at_resume"] - rounds["at_abort"],
            "rounds_before_abort": rounds["before_abort"],
            "bytes": float(model.bytes_sent()),
            "thread_gone": float(algo._thread is None)}


@pytest.mark.parametrize("world_size", [3])
def test_async_keeps_every_update_and_stops_cleanly(world_size: int) -> None:
    for rank, r in enumerate(run_local(_worker, world_size, timeout=120)):
        assert r["error"] <= 1e-5, f"rank {rank}: lost or duplicated update, error {r['error']}"
        assert r["spread"] == 0.0, f"rank {rank}: ranks differ after synchronize()"
        assert r["rounds_before_abort"] >= 1, "no background round ran in 10 steps and 10 s"
        assert r["rounds_while_aborted"] == 0, "rounds ran between abort() and resume()"
        assert r["rounds"] > r["rounds_before_abort"], "no round after resume()"
        assert r["bytes"] > 0 and r["thread_gone"] == 1.0


def test_async_config_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"AsyncConfig\.interval_ms"):
        registry.get("async", interval_ms=-1.0)
