"""Streaming DiLoCo with overlapped exchanges (``overlap_steps = tau > 0``).

Each rank minimises a linear loss, so an SGD step moves every weight by a known,
rank-specific constant and the expected weights can be computed by hand: the closed form of
the first late outer update (world size 2 and 3), and a step-by-step replay of the rule in
``hexagram.algorithms.diloco`` for longer runs with two fragments. Also: uneven ends with
exchanges in flight (``synchronize()`` completes them, no rank hangs), and exact resume
from a checkpoint taken while an exchange is in flight.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hexagram.errors import ConfigError
from hexagram.launch import run_local

LR, OUTER_LR, MU, MIX = 0.1, 0.7, 0.5, 0.5


def _input(rank: int) -> torch.Tensor:
    return torch.tensor([[1.0 + rank, -2.0 * rank, 0.5]])


def _wrap(seed: int = 0, **cfg: Any) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    import hexagram as hx

    torch.manual_seed(seed)
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    algo = hx.algorithms.get("diloco", outer_lr=OUTER_LR, outer_momentum=MU, overlap_mix=MIX,
                             **cfg)
    return net, opt, hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)


def _linear_step(model: Any, opt: torch.optim.Optimizer) -> None:
    """d/dW (W x + b) = x, d/db = 1: weight -= LR * x_rank, bias -= LR."""
    model(_input(dist.get_rank())).sum().backward()
    opt.step()
    opt.zero_grad()


def _closed_form_error() -> float:
    """period 2, one fragment, tau 1: after step 3 the first outer update lands late.

    x_i(3) = x0 - 3 LR c_i;  d = mean_i (x0 - x_i(2)) = 2 LR c_bar;  m = d;
    anchor = x0 - OUTER_LR (d + MU m);  x_i = MIX x_i(3) + (1 - MIX) anchor.
    """
    net, opt, model = _wrap(period=2, overlap_steps=1)
    x0 = net.weight.detach().clone()
    world = dist.get_world_size()
    c_bar = sum(_input(r) for r in range(world)) / world
    for _ in range(3):
        _linear_step(model, opt)
    d = 2 * LR * c_bar
    anchor = x0 - OUTER_LR * (d + MU * d)
    expected = MIX * (x0 - 3 * LR * _input(dist.get_rank())) + (1 - MIX) * anchor
    model.close()
    return (net.weight.detach() - expected).abs().max().item()


def _replay(x0: dict[str, torch.Tensor], frags: list[list[str]], grads: list[dict[str, Any]],
            steps: int, period: int, tau: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's weights after ``steps`` steps, by the documented rule (all contribute)."""
    world = len(grads)
    xs = [{k: v.clone() for k, v in x0.items()} for _ in range(world)]
    anchor = {k: v.clone() for k, v in x0.items()}
    mom = {k: torch.zeros_like(v) for k, v in x0.items()}
    inflight: list[tuple[int, int, int, dict[str, torch.Tensor]]] = []
    rounds = 0

    def apply(f: int, start: int, d: dict[str, torch.Tensor], now: int) -> None:
        for k in frags[f]:
            mom[k] = MU * mom[k] + d[k]
            anchor[k] = anchor[k] - OUTER_LR * (d[k] + MU * mom[k])
            for x in xs:
                x[k] = MIX * x[k] + (1 - MIX) * anchor[k] if now > start else anchor[k].clone()

    for s in range(1, steps + 1):
        for x, g in zip(xs, grads):
            for k in x:
                x[k] = x[k] - LR * g[k]
        while inflight and inflight[0][1] <= s:
            f, _, start, d = inflight.pop(0)
            apply(f, start, d, s)
        if s % (period // len(frags)) == 0:
            f, rounds = rounds % len(frags), rounds + 1
            d = {k: sum(anchor[k] - x[k] for x in xs) / world for k in frags[f]}
            if tau == 0:
                apply(f, s, d, s)
            else:
                inflight.append((f, s + tau, s, d))
    return xs


def _replay_error(period: int, tau: int, steps: int) -> tuple[float, int]:
    """(max error against :func:`_replay`, exchanges still in flight at the end)."""
    net, opt, model = _wrap(period=period, fragments=2, overlap_steps=tau)
    names = {id(p): n for n, p in net.named_parameters()}
    frags = [[names[id(e.param)] for b in f for e in b.entries]
             for f in model.algorithm.fragments]
    x0 = {n: p.detach().clone() for n, p in net.named_parameters()}
    grads = [{"weight": _input(r), "bias": torch.ones(1)} for r in range(dist.get_world_size())]
    for _ in range(steps):
        _linear_step(model, opt)
    expected = _replay(x0, frags, grads, steps, period, tau)[dist.get_rank()]
    error = max((p.detach() - expected[n]).abs().max().item()
                for n, p in net.named_parameters())
    inflight = len(model.algorithm.inflight)
    model.close()
    return error, inflight


def _uneven_spread() -> float:
    """Rank r stops after 5 + 2r steps with an exchange in flight; synchronize() completes
    it, answers the peers' rounds and ends with identical weights on every rank."""
    net, opt, model = _wrap(period=4, fragments=2, overlap_steps=1)
    for _ in range(5 + 2 * dist.get_rank()):
        _linear_step(model, opt)
    model.synchronize()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    model.close()
    return max((g - flat).abs().max().item() for g in gathered)


def _resume() -> dict[str, float]:
    """Save with an exchange in flight; a fresh wrap loaded from it continues identically."""
    cfg = {"period": 4, "fragments": 2, "overlap_steps": 1, "compressor": "qsgd"}
    net, opt, model = _wrap(**cfg)
    for _ in range(6):  # fragment 1's exchange started after step 6, lands after step 7
        _linear_step(model, opt)
    saved = copy.deepcopy((net.state_dict(), opt.state_dict(), model.algorithm_state_dict()))
    for _ in range(7):
        _linear_step(model, opt)
    first = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    model.close()
    net2, opt2, model2 = _wrap(seed=1, **cfg)
    net2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    model2.load_algorithm_state_dict(saved[2])
    for _ in range(7):
        _linear_step(model2, opt2)
    second = torch.cat([p.detach().reshape(-1) for p in net2.parameters()])
    model2.close()
    return {"resume": (first - second).abs().max().item(),
            "saved_inflight": float(len(saved[2]["inflight"]))}


def _worker() -> dict[str, float]:
    import hexagram as hx

    hx.init()
    out = {"closed_form": _closed_form_error(), "uneven_spread": _uneven_spread()}
    for tau, steps in ((1, 10), (3, 11), (0, 9)):  # tau > 0: one still in flight
        out[f"replay/tau={tau}"], out[f"inflight/tau={tau}"] = _replay_error(4, tau, steps)
    out.update(_resume())
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_streaming_diloco_overlap_matches_hand_computed(world_size: int) -> None:
    for rank, r in enumerate(run_local(_worker, world_size, timeout=120)):
        assert r["closed_form"] <= 1e-6, (rank, r)
        for tau in (1, 3, 0):
            assert r[f"replay/tau={tau}"] <= 1e-5, (rank, tau, r)
        assert r["inflight/tau=1"] == 1 and r["inflight/tau=3"] == 1, r
        assert r["uneven_spread"] == 0.0, (rank, r)
        assert r["saved_inflight"] >= 1 and r["resume"] == 0.0, (rank, r)


def test_overlap_config_is_validated() -> None:
    from hexagram.algorithms import registry

    with pytest.raises(ConfigError, match="overlap_steps"):
        registry.get("diloco", period=4, overlap_steps=4)
    with pytest.raises(ConfigError, match="overlap_mix"):
        registry.get("diloco", overlap_mix=1.5)
