"""Exact resume from hx.save_checkpoint / hx.load_checkpoint for every registered algorithm.

One 3-rank launch trains each algorithm in float64 (with dropout, so the global RNG matters)
for K steps, saves, goes on to N, then builds a fresh wrapper from *other* initial weights,
loads the checkpoint and trains K..N again: the final parameters must be bitwise equal.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hexagram.algorithms import registry
from hexagram.launch import run_local

K, N = 7, 12
# Short-run settings so that every algorithm's state is live at the save (compression
# started, a DiLoCo fragment in flight, a local-SGD round due...). Unlisted names: defaults.
CONFIGS: dict[str, dict[str, Any]] = {
    "powersgd": {"start_iter": 3}, "local_sgd": {"period": 3},
    "diloco": {"period": 4, "fragments": 2, "overlap_steps": 1},
    "sparseloco": {"period": 4, "fragments": 2, "overlap_steps": 1},
    "decentralized": {"peers": "random"}, "dgc": {"warmup_steps": 2},
    # auto: decided before the save (profile 2 steps, one 2-step trial); a save during its
    # exploration resumes by exploring again, whose timed choice cannot be bitwise-repeated
    "auto": {"profile_steps": 2, "tie": 0.0, "tune_buckets": 1, "verbose": False},
}

CONTROLS = {"allreduce": ("rng",), "powersgd": ("algorithm",), "qsgd": ("algorithm",)}


def _net(seed: int, hidden: int = 12) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Dropout(0.2),
                         nn.Linear(hidden, 3)).double()


def _optimizer(name: str, net: nn.Module) -> torch.optim.Optimizer:
    if name == "qadam":
        from hexagram.optim import QAdamOptimizer

        return QAdamOptimizer(net.parameters(), lr=0.01, warmup_steps=3)
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def _wrap(name: str, seed: int, hidden: int = 12) -> tuple[Any, torch.optim.Optimizer]:
    import hexagram as hx

    net = _net(seed, hidden)
    opt = _optimizer(name, net)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=registry.get(name, **CONFIGS.get(name, {})))
    if name == "async":  # background rounds follow the clock: explicit rounds instead
        model.algorithm.abort()
    return model, opt


def _step(model: Any, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(
        8, 3, generator=g, dtype=torch.float64)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    if model.algorithm.name == "async":
        model.algorithm.average_now()


def _params(model: Any) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.module.parameters()])


def _resumed_params(name: str, directory: Path, control: str = ""
                    ) -> tuple[int | None, torch.Tensor]:
    """Parameters after resuming from ``directory``; ``control`` drops part of the state
    (the RNG, or the algorithm state) to show that the test notices when it is missing."""
    import hexagram as hx

    model, opt = _wrap(name, seed=1)  # other weights: everything must come from the checkpoint
    fresh = model.algorithm_state_dict()
    start = hx.load_checkpoint(directory, model, [opt], restore_rng=control != "rng")
    if control == "algorithm":
        model.load_algorithm_state_dict(fresh)
    for s in range(start or 0, N):
        _step(model, opt, s)
    params = _params(model)  # before close(): weight algorithms finish a round there
    model.close()
    return start, params


def _resume_diff(name: str, directory: Path) -> dict[str, Any]:
    import hexagram as hx

    model, opt = _wrap(name, seed=0)
    for s in range(K):
        _step(model, opt, s)
    if name == "auto" and model.algorithm.exploring:
        raise AssertionError("auto still exploring at the save: CONFIGS['auto'] too slow")
    hx.save_checkpoint(directory, model, [opt], step=K)
    for s in range(K, N):
        _step(model, opt, s)
    straight = _params(model)
    model.close()
    rng = torch.get_rng_state()
    start, resumed = _resumed_params(name, directory)
    out = {"start": start, "bitwise": torch.equal(straight, resumed),
           "diff": (straight - resumed).abs().max().item()}
    for control in CONTROLS.get(name, ()):
        torch.set_rng_state(rng)  # as it was after the uninterrupted run
        out[control] = (straight - _resumed_params(name, directory, control)[1]).abs().max(
        ).item()
    return out


def _all_algorithms_worker(names: list[str], root: str) -> dict[str, Any]:
    import hexagram as hx

    hx.init(timeout=60)
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = _resume_diff(name, Path(root) / name)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("ckpt")
    return run_local(_all_algorithms_worker, 3, args=(registry.names(), str(root)), timeout=500)


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first test runs the shared 3-rank launch (about 1 min idle)
@pytest.mark.parametrize("name", registry.names())
def test_resume_is_bitwise_identical(resumed: list[dict[str, Any]], name: str) -> None:
    for rank, results in enumerate(resumed):
        result = results[name]
        assert "error" not in result, result.get("error")
        assert result["start"] == K
        assert result["bitwise"], f"{name} rank {rank}: resumed run differs by {result['diff']}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_comparison_notices_missing_state(resumed: list[dict[str, Any]]) -> None:
    """Dropping the RNG (dropout) or the algorithm state (PowerSGD's residuals and Q,
    QSGD's generator) breaks bit-identity: the test above can fail."""
    for results in resumed:
        assert results["allreduce"]["rng"] > 0
        assert results["powersgd"]["algorithm"] > 0
        assert results["qsgd"]["algorithm"] > 0
