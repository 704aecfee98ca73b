"""The cost model's wire bytes equal what every registered gradient algorithm really sends.

One spawned job (3 ranks: uneven chunks, gTop-k's tree) wraps a small model with each
gradient algorithm in turn (registry defaults), runs steps past every warm-up (PowerSGD's
``start_iter``, QAdam's frozen variance), and compares each rank's ``bytes_sent()`` growth
per step with :func:`hexagram.cost.schedule.wire_bytes` for the buckets the engine built.
A 4-rank job checks the power-of-two paths (gTop-k by recursive doubling).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hexagram as hx
from hexagram.algorithms import registry
from hexagram.launch import run_local

STEPS = 3  # the first (reverse-order buckets), the re-bucketed second, a steady third
# steps on both sides of a warm-up: PowerSGD's default start_iter is 10, QAdam's is ours (3)
WARMUP_STEPS = {"powersgd": 12, "qadam": 5}


def gradient_algorithms() -> list[str]:
    """Every registered algorithm that communicates gradients per bucket with a protocol
    of its own (``auto`` delegates: its first steps add its probe and profiling traffic,
    and its later steps are its delegate's, checked here under the delegate's name)."""
    return [n for n in registry.names()
            if registry.get(n).kind == "grad" and not hasattr(registry.get(n), "delegate")]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(37, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 5))


def _optimizer(name: str, params: object) -> torch.optim.Optimizer:
    if name == "qadam":  # QAdam's protocol needs its optimizer (variance frozen after 3)
        from hexagram.optim import QAdamOptimizer

        return QAdamOptimizer(params, lr=1e-3, warmup_steps=3)  # type: ignore[arg-type]
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)  # type: ignore[arg-type]


def _worker(names: list[str]) -> dict[str, list[tuple[int, int]]]:
    from hexagram.cost.schedule import layout_of, wire_bytes

    hx.init()
    rank, world = hx.get_runtime().rank, hx.get_runtime().world_size
    out: dict[str, list[tuple[int, int]]] = {}
    for name in names:
        net = _model()
        opt = _optimizer(name, net.parameters())
        model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=name,
                                           bucket_size_mb=0.01, first_bucket_mb=0.005)
        gen = torch.Generator().manual_seed(rank)
        rows = []
        for step in range(WARMUP_STEPS.get(name, STEPS)):
            x = torch.randn(16, 37, generator=gen)
            before = model.bytes_sent()
            model(x).square().mean().backward()
            measured = model.bytes_sent() - before
            layout = layout_of(model.buckets)
            predicted = wire_bytes(model.algorithm, layout, world, step=step, rank=rank)
            opt.step()
            opt.zero_grad()
            rows.append((measured, predicted))
        model.close()
        out[name] = rows
    hx.shutdown()
    return out


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, list[tuple[int, int]]]]:
    return run_local(_worker, 3, args=(gradient_algorithms(),), timeout=240)


@pytest.mark.parametrize("name", gradient_algorithms())
def test_wire_bytes_equal_bytes_sent(name: str,
                                     three_ranks: list[dict[str, list[tuple[int, int]]]]
                                     ) -> None:
    for rank, result in enumerate(three_ranks):
        for step, (measured, predicted) in enumerate(result[name]):
            assert measured > 0, f"{name}: rank {rank} sent nothing at step {step}"
            assert predicted == measured, (
                f"{name}: rank {rank}, step {step}: model says {predicted} bytes, "
                f"bytes_sent() grew by {measured}")


def test_power_of_two_world() -> None:
    names = ["gtopk", "bytegrad", "powersgd"]
    results = run_local(_worker, 4, args=(names,), timeout=180)
    for rank, result in enumerate(results):
        for name in names:
            for step, (measured, predicted) in enumerate(result[name]):
                assert predicted == measured, (name, rank, step, measured, predicted)
