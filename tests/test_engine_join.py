"""``DistributedDataParallel.join()``: ranks with different numbers of batches.

Rank ``r`` trains ``2 + 2r`` steps (rank 0 may have none). The result is checked against a
single-process replay of the same steps: at step ``t`` the gradient is the sum over the
ranks still training of their gradients, divided by the world size (PyTorch DDP's default)
or by the number of active ranks. Every rank must end with the same weights, and no rank
may hang (run_local's deadline fails the test otherwise).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hexagram.launch import run_local


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)


def _steps(rank: int, first: int) -> int:
    return first + 2 * rank


def _reference(world: int, first: int, by_world: bool) -> list[torch.Tensor]:
    """Replay of the joined training in one process."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for t in range(_steps(world - 1, first)):
        active = [r for r in range(world) if t < _steps(r, first)]
        total = [torch.zeros_like(p) for p in net.parameters()]
        for r in active:
            net.zero_grad()
            x, y = _batch(r, t)
            nn.functional.cross_entropy(net(x), y).backward()
            for acc, p in zip(total, net.parameters()):
                acc.add_(p.grad)
        for acc, p in zip(total, net.parameters()):
            p.grad = acc / (world if by_world else len(active))
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _train(algorithm: str, first: int, by_world: bool, **cfg: object) -> list[torch.Tensor]:
    import torch.distributed as dist

    import hexagram as hx

    rank = dist.get_rank()
    net = _net()
    opt: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    if algorithm == "qadam":
        from hexagram.optim import QAdamOptimizer

        opt = QAdamOptimizer(net.parameters(), lr=0.01, warmup_steps=2)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(algorithm, **cfg))
    with model.join(divide_by_initial_world_size=by_world):
        for t in range(_steps(rank, first)):
            x, y = _batch(rank, t)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    model.close()
    return [p.detach().clone() for p in net.parameters()]


def _worker(first: int) -> dict[str, list[torch.Tensor]]:
    import hexagram as hx

    hx.init()
    return {"allreduce/world": _train("allreduce", first, True),
            "allreduce/active": _train("allreduce", first, False),
            "qsgd": _train("qsgd", first, True),
            "topk": _train("topk", first, True, density=0.2),
            "qadam": _train("qadam", first, True),
            "local_sgd": _train("local_sgd", first, True, period=2)}


@pytest.mark.parametrize(("world", "first"), [(2, 2), (3, 0)])
def test_join_uneven_inputs(world: int, first: int) -> None:
    results = run_local(_worker, world, args=(first,), timeout=240)
    for name, params in results[0].items():
        for rank, other in enumerate(results[1:], start=1):
            for a, b in zip(params, other[name]):
                assert torch.equal(a, b), f"{name}: rank {rank} differs from rank 0"
        assert all(torch.isfinite(p).all() for p in params), name
    for name, by_world in (("allreduce/world", True), ("allreduce/active", False)):
        ref = _reference(world, first, by_world)
        for got, want in zip(results[0][name], ref):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)


def _no_sync_worker() -> list[torch.Tensor]:
    """Gradient accumulation (no_sync) inside join: the joined rank must not shadow it."""
    import torch.distributed as dist

    import hexagram as hx

    hx.init()
    rank = dist.get_rank()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = hx.DistributedDataParallel(net, optimizers=[opt])
    with model.join():
        for t in range(1 + 2 * rank):
            with model.no_sync():
                nn.functional.cross_entropy(model(_batch(rank, 2 * t)[0]),
                                            _batch(rank, 2 * t)[1]).backward()
            x, y = _batch(rank, 2 * t + 1)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    model.close()
    return [p.detach().clone() for p in net.parameters()]


def test_join_with_no_sync() -> None:
    results = run_local(_no_sync_worker, 2, timeout=120)
    for a, b in zip(*results):
        assert torch.equal(a, b)
