"""``delay=1`` around other gradient algorithms, in checkpoints and with uneven inputs.

- compressed algorithms (top-k with error feedback, seeded QSGD): gradients that do not
  depend on the weights make the delayed run deliver, at step t + 1, bit for bit what the
  synchronous run delivers at step t (the inner algorithm, its residuals and random
  streams, sees each gradient once, in order); wire bytes per step are the inner's;
- every registered gradient algorithm trains delayed, replicas equal;
- checkpoint resume is bit-exact; ``join()`` then ``synchronize()`` keeps replicas equal;
- bad input raises errors naming the algorithm.

The update rule itself against hand-computed sequences: ``tests/test_algo_delay.py``.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from _delay_common import LR, STEPS, WORLD, _batch, _net
from torch import nn

import hexagram as hx
from hexagram.algorithms.delay import Delayed
from hexagram.errors import ConfigError
from hexagram.launch import run_local


def _worker() -> dict[str, Any]:
    """Every multi-rank case of this module in one spawned job (one start-up)."""
    os.environ["HEXAGRAM_HOST"] = os.environ["RANK"]  # 2 emulated hosts, 1 rank each
    rank = hx.init(timeout=60).rank
    out = {"compressed": _compressed_worker(rank), "resume": _resume_worker(rank),
           "every": _every_worker(rank), "join": _join_worker(rank)}
    hx.shutdown()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local(_worker, WORLD, timeout=150)


# -- compressed algorithms: the inner algorithm sees each gradient once ------------------------
class Probe(nn.Module):
    """loss = <w, c>: the gradient is ``c`` whatever the weights (fixed sequences)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(6, 40))
        self.b = nn.Parameter(torch.zeros(40))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c[:6]).sum() + (self.b * c[6]).sum()


def _grad(rank: int, step: int) -> torch.Tensor:
    return torch.randn(7, 40, generator=torch.Generator().manual_seed(100 * step + rank))


COMPRESSED = {"topk": {"density": 0.1}, "qsgd": {"levels": 3, "seed": 5}}


def _compressed_worker(rank: int) -> dict[str, Any]:
    from hexagram.cost.schedule import layout_of, wire_bytes

    out: dict[str, Any] = {}
    for name, config in COMPRESSED.items():
        for delay in (0, 1):
            net = Probe()
            opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
            model = hx.DistributedDataParallel(
                net, optimizers=[opt], algorithm=hx.algorithms.get(name, delay=delay, **config),
                bucket_size_mb=0.0)
            grads, sent, predicted = [], [], []
            for step in range(STEPS):
                before = model.bytes_sent()
                model(_grad(rank, step)).backward()
                sent.append(model.bytes_sent() - before)
                predicted.append(wire_bytes(model.algorithm, layout_of(model.buckets), WORLD))
                grads.append(torch.cat([net.w.grad.reshape(-1), net.b.grad]).clone())  # type: ignore[union-attr]
                opt.step()
                opt.zero_grad()
            if delay:
                applied = net.w.detach().clone()
                model.synchronize()  # applies the last pending gradient
                grads.append(-(net.w.detach() - applied).reshape(-1))
            out[f"{name}/{delay}"] = {"grads": grads, "sent": sent, "predicted": predicted,
                                      "total": model.bytes_sent(), "w": net.w.detach().clone()}
            model.close()
    return out


@pytest.fixture(scope="module")
def compressed(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["compressed"] for r in results]


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_compressed_delay_shifts_the_synchronous_sequence(
        name: str, compressed: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(compressed):
        sync, delayed = result[f"{name}/0"]["grads"], result[f"{name}/1"]["grads"]
        assert torch.count_nonzero(delayed[0]) == 0, "step 0 must apply a zero gradient"
        for step in range(STEPS - 1):  # delivered at t + 1 == synchronous at t, bit for bit
            assert torch.equal(delayed[step + 1], sync[step]), (name, rank, step)
        assert torch.count_nonzero(sync[0]) > 0
        # the flush: the last reduced gradient moved w by lr * (momentum-mixed) gradient
        assert torch.count_nonzero(delayed[-1]) > 0, (name, rank)


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_compressed_delay_sends_the_inner_bytes(name: str,
                                                compressed: list[dict[str, Any]]) -> None:
    for result in compressed:
        sync, delayed = result[f"{name}/0"], result[f"{name}/1"]
        # per step, a delayed scatter-gather's second leg may land in the next step's count
        # (it runs on the communicator's thread); once drained, the totals are equal
        assert delayed["total"] == sync["total"] == sum(sync["sent"])
        assert delayed["predicted"] == sync["sent"]  # the cost model sees through delay


def test_compressed_delay_replicas_agree(compressed: list[dict[str, Any]]) -> None:
    for key in compressed[0]:
        assert torch.equal(compressed[0][key]["w"], compressed[1][key]["w"]), key


# -- checkpoints -------------------------------------------------------------------------------
def _train(model: Any, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x, y = _batch(rank, step)
        (model(x.float()) - y.float()).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _wrapped() -> tuple[nn.Module, Any, torch.optim.Optimizer]:
    net = _net().float()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    algo = hx.algorithms.get("topk", delay=1, density=0.3)
    return net, hx.DistributedDataParallel(net, optimizers=[opt],
                                           algorithm=algo, bucket_size_mb=0.0), opt


def _resume_worker(rank: int) -> dict[str, list[torch.Tensor]]:
    net, model, opt = _wrapped()
    _train(model, opt, rank, range(6))
    model.synchronize()
    straight = [p.detach().clone() for p in net.parameters()]
    model.close()

    net, model, opt = _wrapped()
    _train(model, opt, rank, range(3))
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                          "algo": model.algorithm_state_dict()})
    assert ckpt["algo"]["pending"], "step 2's reduced gradient must be in the checkpoint"
    model.close()
    net, model, opt = _wrapped()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    model.load_algorithm_state_dict(ckpt["algo"])
    _train(model, opt, rank, range(3, 6))
    model.synchronize()
    resumed = [p.detach().clone() for p in net.parameters()]
    model.close()
    return {"straight": straight, "resumed": resumed}


def _join_worker(rank: int) -> list[torch.Tensor]:
    """Uneven inputs: rank 0 trains 4 steps, rank 1 two; synchronize() after join()."""
    net, model, opt = _wrapped()
    with model.join():
        _train(model, opt, rank, range(4 if rank == 0 else 2))
    model.synchronize()
    weights = [p.detach().clone() for p in net.parameters()]
    model.close()
    return weights


def test_join_then_synchronize_keeps_replicas_equal(results: list[dict[str, Any]]) -> None:
    first = [p.detach().float() for p in _net().parameters()]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["join"], results[1]["join"]))
    assert not torch.equal(results[0]["join"][0], first[0])


def test_checkpoint_resume_is_exact(results: list[dict[str, Any]]) -> None:
    for result in (r["resume"] for r in results):
        for a, b in zip(result["straight"], result["resumed"]):
            assert torch.equal(a, b)


# -- every gradient algorithm ----------------------------------------------------------------
def _gradient_algorithms() -> list[str]:
    from hexagram.algorithms import registry

    return [n for n in registry.names() if registry.get(n).kind == "grad"]


def _every_worker(rank: int) -> dict[str, list[torch.Tensor]]:
    """Each gradient algorithm with delay=1 (tests/_every_algorithm.py's model, optimizer
    and config): a few steps, then synchronize(); the weights of both ranks must agree."""
    from _every_algorithm import config_for, optimizer_for, small_model

    out = {}
    for name in _gradient_algorithms():
        net = small_model()
        opt = optimizer_for(name, net.parameters())
        algo = hx.algorithms.get(name, delay=1, **config_for(name))
        model = hx.DistributedDataParallel(net, optimizers=[opt],
                                           algorithm=algo, bucket_size_mb=0.001)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        model.synchronize()
        out[name] = [p.detach().clone() for p in net.parameters()]
        model.close()
    return out


@pytest.mark.parametrize("name", _gradient_algorithms())
def test_every_gradient_algorithm_trains_delayed(name: str,
                                                 results: list[dict[str, Any]]) -> None:
    first = [p.detach() for p in _every_small_model().parameters()]
    mine, peer = results[0]["every"][name], results[1]["every"][name]
    assert all(torch.equal(a, b) for a, b in zip(mine, peer)), f"{name}: replicas differ"
    assert not all(torch.equal(a, b) for a, b in zip(mine, first)), f"{name}: never stepped"


def _every_small_model() -> nn.Module:
    from _every_algorithm import small_model

    return small_model()


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["local_sgd", "diloco", "async", "decentralized"])
def test_delay_on_a_weight_algorithm_names_it(name: str) -> None:
    with pytest.raises(ConfigError, match=f"'{name}'.*without delay"):
        hx.algorithms.get(name, delay=1)
    assert not isinstance(hx.algorithms.get(name, delay=0), Delayed)


@pytest.mark.parametrize("delay", [2, -1, True, 0.5, "1"])
def test_delay_out_of_range_names_the_algorithm(delay: Any) -> None:
    with pytest.raises(ConfigError, match="algorithm 'qsgd': delay must be 0"):
        hx.algorithms.get("qsgd", delay=delay)


def test_delay_twice_and_auto_that_may_delay_are_refused() -> None:
    with pytest.raises(ConfigError, match="'topk' is delayed already"):
        hx.algorithms.wrap(hx.algorithms.get("topk", delay=1), delay=1)
    with pytest.raises(ConfigError, match="allow_delay"):
        hx.algorithms.get("auto", delay=1, allow_delay=True)


def test_every_gradient_algorithm_accepts_delay() -> None:
    from hexagram.algorithms import registry

    for name in registry.names():
        if registry.get(name).kind == "grad":
            algo = hx.algorithms.get(name, delay=1)
            assert isinstance(algo, Delayed) and algo.inner.name == name


def test_wire_model_sees_through_delay() -> None:
    from hexagram.cost.schedule import TensorSpec, wire_bytes

    layout = [[TensorSpec("w", (300, 100))], [TensorSpec("b", (100,))]]
    for name in ("allreduce", "topk", "qsgd", "powersgd", "gtopk"):
        assert wire_bytes(hx.algorithms.get(name, delay=1), layout, 4) == \
            wire_bytes(hx.algorithms.get(name), layout, 4), name


def test_delay_warmup_is_checked() -> None:
    with pytest.raises(ConfigError, match="delay_warmup"):
        hx.algorithms.get("topk", delay=1, delay_warmup=-1)
    with pytest.raises(ConfigError, match="delay_warmup applies to delay=1 only"):
        hx.algorithms.get("topk", delay_warmup=5)
