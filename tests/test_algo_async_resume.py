"""Async averaging checkpoints: exact resume with paused rounds, restart while running.

Background rounds happen when the clock says, so a run is only reproducible while they are
paused: after ``abort()`` the test averages with explicit synchronous rounds
(``average_now()``), saves model + optimizer + algorithm state with a correction pending,
continues, and checks that a fresh model resumed from the checkpoint reproduces the same
weights bit for bit.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hexagram.algorithms.async_model_average import AsyncConfig, AsyncModelAverageAlgorithm
from hexagram.errors import ConfigError
from hexagram.launch import run_local

SAVE_AT, MORE = 10, 6


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _step(model: Any, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _continue(model: Any, opt: torch.optim.Optimizer) -> torch.Tensor:
    """MORE steps with a synchronous round every other step; the weights after them."""
    for s in range(SAVE_AT, SAVE_AT + MORE):
        _step(model, opt, s)
        if s % 2 == 1:
            model.algorithm.average_now()
    _step(model, opt, SAVE_AT + MORE)  # its forward adds the last pending correction
    return torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])


def _wrap(seed: int) -> tuple[Any, torch.optim.Optimizer]:
    import hexagram as hx

    net = _net(seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return hx.DistributedDataParallel(net, optimizers=[opt],
                                      algorithm=hx.algorithms.get("async", interval_ms=2.0)
                                      ), opt


def _worker() -> dict[str, Any]:
    import hexagram as hx

    hx.init()
    model, opt = _wrap(0)
    for s in range(5):  # background rounds: timing-dependent, before the paused part
        _step(model, opt, s)
    model.algorithm.abort()
    for s in range(5, SAVE_AT):
        _step(model, opt, s)
        model.algorithm.average_now()  # pending until the next forward
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), model.algorithm_state_dict()))
    first = _continue(model, opt)
    model.close()
    resumed, opt2 = _wrap(1)  # other initial weights: everything must come from the checkpoint
    resumed.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    resumed.load_algorithm_state_dict(saved[2])
    out = {"thread_after_load": resumed.algorithm._thread is not None,
           "diff": (first - _continue(resumed, opt2)).abs().max().item(),
           "pending_saved": saved[2]["pending"] is not None, "aborted": saved[2]["aborted"]}
    resumed.close()
    out.update(_restart_while_running())
    return out


def _restart_while_running() -> dict[str, Any]:
    """A checkpoint taken with the thread running restarts it on load; synchronize() ends
    with identical weights."""
    model, opt = _wrap(0)
    for s in range(4):
        _step(model, opt, s)
    state = copy.deepcopy((model.state_dict(), model.algorithm_state_dict()))
    model.close()
    again, opt2 = _wrap(1)
    again.load_state_dict(state[0])
    again.load_algorithm_state_dict(state[1])
    running = again.algorithm._thread is not None
    for s in range(4, 8):
        _step(again, opt2, s)
    again.synchronize()
    w = torch.cat([p.detach().reshape(-1) for p in again.module.parameters()])
    gathered = [torch.empty_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, w)
    again.close()
    return {"saved_running_aborted": state[1]["aborted"], "running_after_load": running,
            "spread": max((g - w).abs().max().item() for g in gathered)}


def test_async_resume_is_exact_with_paused_rounds() -> None:
    for rank, r in enumerate(run_local(_worker, 3, timeout=120)):
        assert r["pending_saved"] and r["aborted"], (rank, r)
        assert not r["thread_after_load"], (rank, "an aborted checkpoint restarted the thread")
        assert r["diff"] == 0.0, (rank, r)
        assert r["saved_running_aborted"] is False and r["running_after_load"], (rank, r)
        assert r["spread"] == 0.0, (rank, r)


def test_async_load_refuses_other_interval() -> None:
    algo = AsyncModelAverageAlgorithm(AsyncConfig(interval_ms=5.0))
    with pytest.raises(ConfigError, match="interval_ms"):
        algo.load_state_dict({"interval_ms": 50.0, "rounds": 0, "pending": None,
                              "aborted": True})
