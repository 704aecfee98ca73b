"""Decentralized algorithms: the mixing mathematics, odd world sizes, uneven data, resume.

One spawned job per world size runs every check (wrapping a fresh model each time) to
amortise process start-up. Expected weights are hand-computed from every rank's weights and
gradients, gathered with plain torch.distributed collectives.
"""

from __future__ import annotations

import copy

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
    return torch.cat([p.grad.detach().reshape(-1) for p in module.parameters()])  # type: ignore[union-attr]


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)


def _wrap(algo: str, **cfg: object) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """A wrapped model whose weights differ per rank *after* wrapping (wrap makes them equal)."""
    import hexagram as hx

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model = hx.DistributedDataParallel(net, [opt], hx.algorithms.get(algo, **cfg))
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
    model.close()  # type: ignore[operator]
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
    model.close()  # type: ignore[operator]
    return (_flat(net) - (before - LR * grad)).abs().max().item()


def _low_precision_error() -> float:
    """CHOCO round with fp16: x_i' + sum_nbrs w (h_j - h_i), h_j = x0 + Q(x_j' - x0).

    Computed in the (single) bucket's layout, which is reversed parameter order.
    """
    import hexagram.compress as hc

    model, opt, net = _wrap("low_precision_decentralized", compressor="fp16")
    rank, size = dist.get_rank(), dist.get_world_size()
    x0 = model.algorithm.replicas["self"][0].clone()  # type: ignore[attr-defined]
    start = _bucket_layout(net, _flat(net))
    x, y = _batch(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    stepped = _gather(start - LR * _bucket_layout(net, _grads(net)))  # x_j' after SGD
    opt.step()
    c = hc.get("fp16")
    public = [x0 + c.decompress(c.compress(s - x0)) for s in stepped]
    peers = select_peers("ring", rank, size)
    mixed = stepped[rank] + sum(public[j] - public[rank] for j in peers) / (len(peers) + 1)
    model.close()  # type: ignore[operator]
    return (_bucket_layout(net, _flat(net)) - mixed).abs().max().item()


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
    model.synchronize()  # type: ignore[operator]
    spread = max((w - _flat(net)).abs().max().item() for w in _gather(_flat(net)))
    model.close()  # type: ignore[operator]
    return spread


def _resume_error() -> float:
    """Checkpoint after 3 steps, 3 more steps; reload into a fresh wrap: identical result."""
    model, opt, net = _wrap("low_precision_decentralized", compressor="fp16")
    for step in range(3):
        _train_step(model, opt, step)
    saved = copy.deepcopy((net.state_dict(), model.algorithm_state_dict(),  # type: ignore[operator]
                           opt.state_dict()))
    for step in range(3, 6):
        _train_step(model, opt, step)
    first = _flat(net)
    model.close()  # type: ignore[operator]
    model2, opt2, net2 = _wrap("low_precision_decentralized", compressor="fp16")
    net2.load_state_dict(saved[0])  # type: ignore[attr-defined]
    model2.load_algorithm_state_dict(saved[1])  # type: ignore[operator]
    opt2.load_state_dict(saved[2])
    for step in range(3, 6):
        _train_step(model2, opt2, step)
    model2.close()  # type: ignore[operator]
    return (first - _flat(net2)).abs().max().item()


def _worker() -> dict[str, float]:
    import hexagram as hx

    hx.init()
    out = {f"mix/{p}": _mixing_error(p) for p in ("all", "ring", "shift_one", "random")}
    out["interval"] = _interval_error()
    out["low_precision"] = _low_precision_error()
    for algo, cfg in (("decentralized", {"peers": "ring"}),
                      ("decentralized", {"peers": "shift_one"}),
                      ("low_precision_decentralized", {"compressor": "fp16"})):
        out[f"uneven/{algo}/{cfg}"] = _uneven_and_synchronize(algo, **cfg)
    out["resume"] = _resume_error()
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_decentralized_math_uneven_and_resume(world_size: int) -> None:
    for rank, result in enumerate(run_local(_worker, world_size, timeout=120)):
        for key, err in result.items():
            tol = 1e-5 if key == "low_precision" else 1e-6
            assert err <= tol, f"world {world_size} rank {rank} {key}: error {err}"


def test_configs_reject_bad_values_with_the_field_name() -> None:
    with pytest.raises(ConfigError, match="DecentralizedConfig.peers"):
        registry.get("decentralized", peers="star")
    with pytest.raises(ConfigError, match="DecentralizedConfig.interval"):
        registry.get("decentralized", interval=0)
    with pytest.raises(ConfigError, match="gamma"):
        registry.get("low_precision_decentralized", compressor="fp16", gamma=0.0)
    with pytest.raises(ConfigError, match="compressor"):
        registry.get("low_precision_decentralized", compressor=8)
    with pytest.raises(ValueError, match="unknown compressor"):
        registry.get("low_precision_decentralized", compressor="nope")
