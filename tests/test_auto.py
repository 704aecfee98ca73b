"""``algorithm="auto"``: bad input, one decision on every rank, switching, resuming.

Multi-process checks run 3 ranks on loopback with a short probe; they assert behaviour
(same decision and weights on every rank, residuals flushed exactly on a switch, the
decision kept on resume), never a speed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

import hexagram as hx
from hexagram.auto import choose
from hexagram.errors import ConfigError
from hexagram.launch import run_local

FAST = {"candidates": ["allreduce", "fp16", "topk", "powersgd"], "probe_budget_s": 0.5,
        "verbose": False}


# -- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, words", [
    ({"candidates": ["allreduce", "nope"]}, "unknown candidate 'nope'"),
    ({"candidates": []}, "non-empty"),
    ({"candidates": ["topk", "powersgd"], "lossy": False}, "lossy=False"),
    ({"candidates": ["local_sgd"]}, "allow_delay=True"),
    ({"candidates": ["auto"]}, "cannot be its own candidate"),
    ({"candidates": ["fp16:wire"]}, "NAME[:FIELD=VALUE"),
    ({"candidates": ["qsgd:levels=0"]}, "levels"),
])
def test_bad_candidates(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        hx.algorithms.get("auto", **kwargs)
    assert words in str(info.value)


def test_candidate_sets() -> None:
    lossless = [label for label, _ in choose.resolve(None, lossy=False)]
    assert lossless == ["allreduce", "allreduce:hierarchical=true"]
    delayed = [label for label, _ in choose.resolve(None, allow_delay=True)]
    assert set(choose.DELAYED) <= set(delayed)
    assert not set(choose.DELAYED) & {label for label, _ in choose.resolve(None)}
    algo = hx.algorithms.get("auto", candidates=["fp16:wire=bf16"])
    assert algo.candidates[0][1].config.wire == "bf16"


# -- multi-process -----------------------------------------------------------------------
class Probe(nn.Module):
    """loss = <w, x>: the gradient is x exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(64, 32))
        self.b = nn.Parameter(torch.zeros(300))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x[:2048].view(64, 32)).sum() + (self.b * x[2048:]).sum()


def _grad(step: int, rank: int) -> torch.Tensor:
    return torch.randn(2348, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: Any, opt: torch.optim.Optimizer, steps: range, rank: int) -> None:
    for step in steps:
        model(_grad(step, rank)).backward()
        opt.step()
        opt.zero_grad()


def _decide_switch_resume() -> dict[str, Any]:
    hx.init()
    rank, world = hx.get_runtime().rank, hx.get_runtime().world_size
    net = Probe()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    algo = hx.algorithms.get("auto", **FAST)
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)
    _train(model, opt, range(12), rank)
    out: dict[str, Any] = {"decision": dict(algo.decision or {}), "label": algo.label,
                           "bucket": algo.bucket_size_bytes(), "table": algo.table,
                           "weights": net.w.detach().clone()}
    # switch from top-k (residuals) to allreduce: the residuals join the next gradient
    algo.switch("topk")
    _train(model, opt, range(12, 14), rank)
    assert algo.label == "topk"
    ef = algo.delegate.error_feedback  # type: ignore[attr-defined]
    residual = torch.cat([ef.residual("w").reshape(-1), ef.residual("b").reshape(-1)])
    before = torch.cat([net.w.detach().reshape(-1), net.b.detach().reshape(-1)]).clone()
    algo.switch("allreduce")
    _train(model, opt, range(14, 15), rank)
    after = torch.cat([net.w.detach().reshape(-1), net.b.detach().reshape(-1)])
    sent = _grad(14, rank) + residual
    total = sent.clone()
    torch.distributed.all_reduce(total)
    out["flush_error"] = float((before - total / world - after).abs().max())
    out["switches"] = algo.switches
    state = model.algorithm_state_dict()
    model.close()
    # resume: a fresh auto keeps the saved decision
    net2 = Probe()
    opt2 = torch.optim.SGD(net2.parameters(), lr=1.0)
    algo2 = hx.algorithms.get("auto", **FAST)
    model2 = hx.DistributedDataParallel(net2, optimizers=[opt2], algorithm=algo2)
    model2.load_algorithm_state_dict(state)
    _train(model2, opt2, range(3), rank)
    out["resumed"] = (algo2.label, algo2.decision == state["decision"], len(algo2.switches))
    model2.close()
    # drift: steps become much slower than measured after the decision -> a new probe
    net3 = Probe()
    opt3 = torch.optim.SGD(net3.parameters(), lr=0.1)
    algo3 = hx.algorithms.get("auto", **{**FAST, "drift_steps": 3})
    model3 = hx.DistributedDataParallel(net3, optimizers=[opt3], algorithm=algo3)
    _train(model3, opt3, range(14), rank)
    quiet = algo3.reprobes
    for step in range(14, 26):
        _train(model3, opt3, range(step, step + 1), rank)
        time.sleep(0.3)  # the job's step time drifts (as when a link slows down)
    out["reprobes"] = (quiet, algo3.reprobes)
    model3.close()
    out["warmup"] = _tuned_after_warmup(rank)
    out["trials"] = _timed_trials(rank)
    hx.shutdown()
    return out


def _timed_trials(rank: int) -> tuple[dict[str, Any], str]:
    """Candidates predicted within ``tie`` of each other are timed, not trusted to the
    model (``tie=10``: any two candidates count as tied)."""
    net = Probe()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    algo = hx.algorithms.get("auto", **{**FAST, "candidates": ["allreduce", "fp16"],
                                        "tie": 10.0})
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)
    _train(model, opt, range(12), rank)
    model.close()
    return dict(algo.decision or {}), algo.label


def _tuned_after_warmup(rank: int) -> tuple[bool, bool, list[str]]:
    """PowerSGD with its 10 allreduce warm-up steps: buckets are timed after them. The
    Probe's 9 KB of gradients: 1 KB buckets give two (w, b), 1 and 4 MB both one bucket,
    so only two sizes are distinct configurations."""
    net = Probe()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    algo = hx.algorithms.get("auto", **{**FAST, "candidates": ["powersgd"],
                                        "bucket_mb": (0.001, 1.0, 4.0)})
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)
    _train(model, opt, range(10), rank)
    during = "tuned" in (algo.decision or {})
    _train(model, opt, range(10, 20), rank)
    tuned = (algo.decision or {}).get("tuned")
    model.close()
    return during, tuned is not None, sorted(tuned or {})


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, Any]]:
    return run_local(_decide_switch_resume, 3, timeout=240)


def test_same_decision_on_every_rank(three_ranks: list[dict[str, Any]]) -> None:
    first = three_ranks[0]
    assert first["label"] in FAST["candidates"]
    assert first["decision"]["label"] == first["label"]
    assert "tuned" in first["decision"] or first["bucket"] is not None
    for other in three_ranks[1:]:
        assert other["decision"] == first["decision"]
        assert other["bucket"] == first["bucket"]
        assert torch.equal(other["weights"], first["weights"])
    assert "<- chosen" in first["table"] and "choice:" in first["table"]


def test_switch_flushes_residuals(three_ranks: list[dict[str, Any]]) -> None:
    for result in three_ranks:
        assert result["flush_error"] < 1e-5
        assert [s["to"] for s in result["switches"]][-1] == "allreduce"
        assert "flushed" in result["switches"][-1]["state"]


def test_resume_keeps_decision(three_ranks: list[dict[str, Any]]) -> None:
    for result in three_ranks:
        label, same, _ = result["resumed"]
        assert label == "allreduce" and same


def test_drift_triggers_a_new_probe(three_ranks: list[dict[str, Any]]) -> None:
    for result in three_ranks:
        quiet, after = result["reprobes"]
        assert after > quiet


def test_buckets_timed_after_warmup(three_ranks: list[dict[str, Any]]) -> None:
    """Timing PowerSGD's allreduce warm-up steps would tune for (and expect) the wrong
    step time; auto waits for the steps the model predicts."""
    for result in three_ranks:
        during, after, sizes = result["warmup"]
        assert (during, after) == (False, True)
        assert len(sizes) == 2 and sizes != ["1 MB", "4 MB"]  # distinct layouts only


def test_tied_candidates_are_timed(three_ranks: list[dict[str, Any]]) -> None:
    decision, label = three_ranks[0]["trials"]
    tuned = decision["tuned"]
    assert sorted(k.split(" @ ")[0] for k in tuned) == ["allreduce", "fp16"]
    chosen = next(k for k in tuned if k.split(" @ ")[0] == label)
    assert decision["label"] == label
    # the fastest measured, or exact allreduce within prefer_exact (5 %) of a lossy fastest
    assert tuned[chosen] == min(tuned.values()) or (
        label == "allreduce" and tuned[chosen] <= 1.05 * min(tuned.values()) + 1e-4)
    assert all(r["trials"] == (decision, label) for r in three_ranks[1:])


def test_default_powersgd_compresses_at_once() -> None:
    assert not choose.warming_up(choose.make("powersgd:start_iter=0"))
    assert choose.warming_up(choose.make("powersgd"))
    assert "powersgd:start_iter=0" in choose.DEFAULT


def _single() -> tuple[str, dict[str, Any] | None, float]:
    hx.init()
    net = Probe()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    algo = hx.algorithms.get("auto", **FAST)
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)
    _train(model, opt, range(6), 0)
    out = (algo.label, algo.decision, net.b.detach().abs().sum().item())
    model.close()
    hx.shutdown()
    return out


def test_one_rank_needs_no_probe() -> None:
    """A single process (the README's example without torchrun) runs allreduce, a no-op,
    without probing a network it does not have or printing a table."""
    label, decision, moved = run_local(_single, 1, timeout=120)[0]
    assert label == "allreduce" and decision == {"label": "allreduce", "reason": "one rank"}
    assert moved > 0  # it trained


def _step_ops(name: str) -> tuple[int, bool, bool]:
    """aten ops of one training step of a 128-tensor MLP wrapped with ``name`` (steps 0-2
    first: re-bucketing done), whether the engine checks each rank's own gradient for
    non-finite values before the reduction, and
    whether ``name`` declares its reduction passes them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            self.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(64)])
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=hx.algorithms.get(
        name, **({"verbose": False} if name == "auto" else {})))
    x = torch.randn(4, 8)
    for _ in range(4):
        with Count() as count:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    reducer = model._reducer
    # the check of each rank's own gradient before reduction (every gradient algorithm's
    # reduced result is checked too: a constant per bucket, the same for both)
    out = (count.n, reducer is not None and reducer.guard is not None and reducer.guard.local,
           bool(model.algorithm.passes_nonfinite))
    model.close()
    return out


def _one_rank_cost() -> dict[str, tuple[int, bool, bool]]:
    hx.init()
    out = {name: _step_ops(name) for name in ("allreduce", "auto")}
    hx.shutdown()
    return out


def test_one_rank_costs_what_allreduce_costs() -> None:
    """At one rank auto delegates to allreduce and adds nothing per step: no non-finite
    check (allreduce's sum passes NaN/Inf on), no step recorder hooks; its step dispatches
    the aten ops allreduce's does, within a small constant (counted on a 128-tensor model,
    where anything per tensor would show a hundred times over)."""
    (out,) = run_local(_one_rank_cost, 1, timeout=120)
    ops, guarded, passes = out["auto"]
    assert not guarded and passes
    assert not out["allreduce"][1]
    assert abs(ops - out["allreduce"][0]) <= 4, out
