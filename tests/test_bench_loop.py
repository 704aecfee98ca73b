"""The measurement tools' one training loop (hexagram.bench.loop): the step, faults at their
step, a clock of training steps only, and one stop decision on every rank."""

from __future__ import annotations

import doctest
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hexagram.bench import loop as loop_module
from hexagram.bench.loop import Loop, Progress, run_epochs, train_step
from hexagram.launch import run_local
from hexagram.testing.faults import Fault, FaultInjector, InjectedFault


def test_the_module_example_runs() -> None:
    assert doctest.testmod(loop_module).failed == 0


def test_train_step_runs_the_hook_between_the_update_and_zero_grad() -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model.weight.detach().clone()
    seen: list[bool] = []

    def after_step() -> None:  # model averaging sees the updated weights, grads still set
        seen.append(model.weight.grad is not None and not torch.equal(model.weight, before))

    step = train_step(model, opt, nn.functional.mse_loss, after_step)
    x, y = torch.ones(2, 3), torch.zeros(2, 1)
    expected = nn.functional.mse_loss(model(x), y).detach()
    assert torch.equal(step(x, y), expected)  # the loss before the update
    assert seen == [True] and model.weight.grad is None  # zero_grad last


def test_a_fault_fires_at_its_step_before_the_step_runs() -> None:
    ran: list[int] = []
    loop = Loop(step=lambda x, y: ran.append(x), faults=FaultInjector(
        [Fault(rank=0, step=3, action="raise"), Fault(rank=1, step=1, action="raise")], 0))
    for i in range(3):
        loop.run(i, None)  # rank 1's fault at step 1 is not this rank's
    with pytest.raises(InjectedFault, match="on rank 0 at step 3"):
        loop.run(3, None)
    assert ran == [0, 1, 2] and loop.steps == 3 and len(loop.times) == 3
    with pytest.raises(InjectedFault):  # live mode numbers steps itself (committed ones)
        Loop(step=lambda x, y: None, faults=loop.faults).run(0, None, at=3)


def test_evaluations_spread_over_the_epoch_and_end_it() -> None:
    assert loop_module.eval_marks(10, 3) == {3, 7, 10}
    assert loop_module.eval_marks(10, 1) == {10}
    assert loop_module.eval_marks(3, 5) == {1, 2, 3}  # more evaluations than batches


# -- two real ranks: what they agree on --------------------------------------------------

def _ranks() -> dict[str, Any]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {"target": _to_target(rank), "limit": _to_time_limit(rank), "inside": _inside(rank)}
    dist.destroy_process_group()
    return out


def _slow_step_on_rank_1(rank: int) -> Any:
    return lambda x, y: time.sleep(0.01 if rank == 1 else 0.0)


def _to_target(rank: int) -> dict[str, Any]:
    """Rank 0's metric rises 0.01 a step, rank 1's 0.05: alone they would reach 0.3 at
    steps 30 and 6; the mean (0.03 a step) does at step 10, on both. Evaluation sleeps
    far longer than a step: the clock must not count it."""
    loop = Loop(step=_slow_step_on_rank_1(rank))
    rate = 0.01 if rank == 0 else 0.05

    def evaluate() -> float:
        time.sleep(0.05)
        return rate * loop.steps

    progress = Progress(evaluate=evaluate, reached_by=lambda v: v >= 0.3 - 1e-9)
    run_epochs(loop, progress, lambda epoch: [(None, None)] * 4, epochs=10,
               evals_per_epoch=2)
    return {"curve": progress.curve, "reached": progress.reached, "times": loop.times}


def _to_time_limit(rank: int) -> dict[str, Any]:
    """Rank 1's steps take >= 10 ms, rank 0's next to nothing: the slower clock decides."""
    loop = Loop(step=_slow_step_on_rank_1(rank))
    progress = Progress(evaluate=lambda: 0.0, time_limit=0.035)
    run_epochs(loop, progress, lambda epoch: [(None, None)] * 2, epochs=50,
               evals_per_epoch=1)
    return {"curve": progress.curve, "steps": loop.steps}


def _inside(rank: int) -> dict[str, Any]:
    """Rank 1's fault at step 2 fires after the step's first all_reduce completed."""
    value = torch.zeros(1)

    def step(x: Any, y: Any) -> None:
        value.fill_(1.0)
        dist.all_reduce(value)

    original = dist.all_reduce
    loop = Loop(step=step, faults=FaultInjector([Fault(1, 2, "raise")], rank),
                inside="all_reduce:1")
    raised = ""
    try:
        for _ in range(4):
            loop.run(None, None)
    except InjectedFault as exc:
        raised = str(exc)
        dist.all_reduce(torch.ones(1))  # rank 0's step 3: its peer answers once more
    return {"raised": raised, "value": float(value[0]), "steps": loop.steps,
            "restored": dist.all_reduce is original}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_local(_ranks, 2, timeout=120)


@pytest.mark.timeout(150)
def test_every_rank_stops_at_the_same_step_on_the_mean_metric(
        ranks: list[dict[str, Any]]) -> None:
    first, second = (r["target"] for r in ranks)
    assert first["curve"] == second["curve"] and first["reached"] == second["reached"]
    assert [p["step"] for p in first["curve"]] == [0, 2, 4, 6, 8, 10]
    assert first["reached"]["step"] == 10 and first["reached"]["epoch"] == 2.5
    assert first["reached"]["metric"] == pytest.approx(0.3)
    assert len(first["times"]) == len(second["times"]) == 10


@pytest.mark.timeout(150)
def test_the_clock_counts_the_steps_not_the_evaluations(ranks: list[dict[str, Any]]) -> None:
    """Each point's time is the slower rank's sum of step times up to it: the 50 ms
    evaluations before it are not in it."""
    first, second = (r["target"] for r in ranks)
    for point in first["curve"]:
        s = point["step"]
        slower = max(sum(first["times"][:s]), sum(second["times"][:s]))
        assert point["time_s"] == pytest.approx(slower, rel=1e-9, abs=1e-12)


@pytest.mark.timeout(150)
def test_the_time_limit_stops_every_rank_at_the_same_step(
        ranks: list[dict[str, Any]]) -> None:
    first, second = (r["limit"] for r in ranks)
    assert first == second  # same curve, same steps
    *before, last = first["curve"]
    assert last["time_s"] > 0.035 >= before[-1]["time_s"] and first["steps"] < 100


@pytest.mark.timeout(150)
def test_a_fault_inside_a_collective_fires_after_it(ranks: list[dict[str, Any]]) -> None:
    quiet, failed = (r["inside"] for r in ranks)
    assert quiet == {"raised": "", "value": 2.0, "steps": 4, "restored": True}
    assert failed["raised"] == "injected fault after all_reduce call 1 on rank 1"
    assert failed["value"] == 2.0 and failed["steps"] == 2 and failed["restored"]
