"""Decentralized algorithms: the mixing mathematics, odd world sizes, uneven data, resume.

One spawned job per world size runs every check (wrapping a fresh model each time) to
amortise process start-up. Expected weights are hand-computed from every rank's weights and
gradients, gathered with plain torch.distributed collectives.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hexagram.algorithms import registry
from hexagram.comm.peers import select_peers
from hexagram.errors import ConfigError
from hexagram.launch import run_local

LR = 0.1


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1) for p in module.parameters()
                      if p.grad is not None])


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)


def _wrap(algo: str, **cfg: object) -> tuple[Any, torch.optim.Optimizer, nn.Module]:
    """A wrapped model whose weights differ per rank *after* wrapping (wrap makes them equal)."""
    import hexagram as hx

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(algo, **cfg))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * dist.get_rank() * torch.ones_like(p) + 0.01 * torch.randn_like(p))
    return model, opt, net


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(dist.get_rank(), step)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _mixing_error(peers: str) -> float:
    """One step of D-PSGD: x_i <- mean over {i} + peers of x_j  -  lr * grad_i(x_i)."""
    model, opt, net = _wrap("decentralized", peers=peers)
    rank, size = dist.get_rank(), dist.get_world_size()
    before = _gather(_flat(net))
    x, y = _batch(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    grad = _grads(net)
    opt.step()
    group = [rank, *select_peers(peers, rank, size, step=0)]
    expected = torch.stack([before[j] for j in group]).mean(0) - LR * grad
    model.close()
    return (_flat(net) - expected).abs().max().item()


def _interval_error() -> float:
    """interval=2: step 0 mixes, step 1 is purely local."""
    model, opt, net = _wrap("decentralized", peers="ring", interval=2)
    _train_step(model, opt, 0)
    before = _flat(net)
    x, y = _batch(dist.get_rank(), 1)
    nn.functional.cross_entropy(model(x), y).backward()
    grad = _grads(net)
    opt.step()
    model.close()
    return (_flat(net) - (before - LR * grad)).abs().max().item()


def _low_precision_error() -> float:
    """One CHOCO round with 8-bit min-max (single bucket, reversed parameter order).

    Checks: (a) my copy of each neighbour's public weights h_j equals that neighbour's own
    h_j bit for bit; (b) h_i = x0 + Q(x_i' - x0) is within min-max's error bound
    (range / 510) of my stepped weights x_i'; (c) x_i = x_i' + sum_nbrs (h_j - h_i) / (k+1).
    """
    model, opt, net = _wrap("low_precision_decentralized")
    rank, size = dist.get_rank(), dist.get_world_size()
    algo = model.algorithm
    x0 = algo.replicas["self"][0].clone()
    start = _bucket_layout(net, _flat(net))
    x, y = _batch(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    stepped = start - LR * _bucket_layout(net, _grads(net))  # x_i' as SGD computes it
    opt.step()
    public = _gather(algo.replicas["self"][0])
    peers = select_peers("ring", rank, size)
    copies = max((algo.replicas[str(j)][0] - public[j]).abs().max().item() for j in peers)
    change = stepped - x0
    bound = (change.max() - change.min()).item() / 510 * 1.001 + 1e-7
    outside = max(0.0, (public[rank] - stepped).abs().max().item() - bound)
    mixed = stepped + sum(public[j] - public[rank] for j in peers) / (len(peers) + 1)
    model.close()
    return max(copies, outside, (_bucket_layout(net, _flat(net)) - mixed).abs().max().item())


def _bucket_layout(net: nn.Module, flat: torch.Tensor) -> torch.Tensor:
    """Parameter-order flat -> the single bucket's layout (reversed parameter order)."""
    parts, offset = [], 0
    for p in net.parameters():
        parts.append(flat[offset : offset + p.numel()])
        offset += p.numel()
    return torch.cat(list(reversed(parts)))


def _uneven_and_synchronize(algo: str, **cfg: object) -> float:
    """Rank r runs 3 + 2r steps, then synchronize(): no hang, identical weights."""
    model, opt, net = _wrap(algo, **cfg)
    for step in range(3 + 2 * dist.get_rank()):
        _train_step(model, opt, step)
    model.synchronize()
    spread = max((w - _flat(net)).abs().max().item() for w in _gather(_flat(net)))
    model.close()
    return spread


def _resume_error() -> float:
    """Checkpoint after 3 steps, 3 more steps; reload into a fresh wrap: identical result."""
    model, opt, net = _wrap("low_precision_decentralized")
    for step in range(3):
        _train_step(model, opt, step)
    saved = copy.deepcopy((net.state_dict(), model.algorithm_state_dict(),
                           opt.state_dict()))
    for step in range(3, 6):
        _train_step(model, opt, step)
    first = _flat(net)
    model.close()
    model2, opt2, net2 = _wrap("low_precision_decentralized")
    wrong = dict(saved[1], replicas={"self": saved[1]["replicas"]["self"], "99": {}})
    try:  # replicas of other neighbours (another world size or rank): refused, not misused
        model2.load_algorithm_state_dict(wrong)
        return 1.0
    except ValueError:
        pass
    net2.load_state_dict(saved[0])
    model2.load_algorithm_state_dict(saved[1])
    opt2.load_state_dict(saved[2])
    for step in range(3, 6):
        _train_step(model2, opt2, step)
    model2.close()
    return (first - _flat(net2)).abs().max().item()


def _worker() -> dict[str, float]:
    import hexagram as hx

    hx.init()
    out = {f"mix/{p}": _mixing_error(p) for p in ("all", "ring", "shift_one", "random")}
    out["interval"] = _interval_error()
    out["low_precision"] = _low_precision_error()
    for algo, cfg in (("decentralized", {"peers": "ring"}),
                      ("decentralized", {"peers": "shift_one"}),
                      ("low_precision_decentralized", {})):
        out[f"uneven/{algo}/{cfg}"] = _uneven_and_synchronize(algo, **cfg)
    out["resume"] = _resume_error()
    return out


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_decentralized_math_uneven_and_resume(world_size: int) -> None:
    for rank, result in enumerate(run_local(_worker, world_size, timeout=120)):
        assert len(result) >= 3, f"rank {rank} measured only {sorted(result)}"
        for key, err in result.items():
            tol = 1e-6
            assert err <= tol, f"world {world_size} rank {rank} {key}: error {err}"


def test_configs_reject_bad_values_with_the_field_name() -> None:
    with pytest.raises(ConfigError, match=r"DecentralizedConfig\.peers"):
        registry.get("decentralized", peers="star")
    with pytest.raises(ConfigError, match=r"DecentralizedConfig\.interval"):
        registry.get("decentralized", interval=0)
    with pytest.raises(ConfigError, match="gamma"):
        registry.get("low_precision_decentralized", compressor="fp16", gamma=0.0)
    with pytest.raises(ConfigError, match="compressor"):
        registry.get("low_precision_decentralized", compressor=8)
    with pytest.raises(ValueError, match=r"compressor .* is not registered"):
        registry.get("low_precision_decentralized", compressor="nope")


def _nan_round_worker() -> str:
    """low_precision_decentralized on 2 ranks, rank 1's weights NaN before its second
    step: the error each rank raised in that round ("" if none)."""
    import hexagram as hx

    hx.init()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model = hx.DistributedDataParallel(
        net, optimizers=[opt], algorithm=registry.get("low_precision_decentralized"))
    error = ""
    try:
        for step in range(2):
            model(torch.randn(4, 5)).sum().backward()
            if step == 1 and dist.get_rank() == 1:
                with torch.no_grad():
                    next(net.parameters())[0, 0] = float("nan")
            try:
                opt.step()  # the round runs after the step
            except hx.NonFiniteGradientError as exc:
                error = str(exc)
            opt.zero_grad()
    finally:
        model.close()
    return error


def test_low_precision_nan_weights_stop_every_rank_in_the_same_round() -> None:
    # the payloads' NaN/Inf flag rides in the round's control collective (its one read)
    for error in run_local(_nan_round_worker, 2, timeout=120):
        assert "1 rank(s) hold NaN or Inf at round 2" in error, error
