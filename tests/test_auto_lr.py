"""Algorithms that need another learning rate say so by a factor; auto never picks them.

The factor is machine-readable (:func:`hexagram.auto.choose.lr_note`), never parsed from a
warning; DGC's wrap-time behaviour is in tests/test_dgc_takeover.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hexagram as hx
from hexagram.auto import choose
from hexagram.auto.algorithm import AutoAlgorithm, AutoConfig
from hexagram.cost.model import Prediction
from hexagram.errors import ConfigError
from hexagram.launch import run_local


def _sgd(momentum: float = 0.9, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.05, momentum=momentum,
                           weight_decay=weight_decay)


@pytest.mark.parametrize("label, momentum, factor", [
    ("signsgd:scaled=false", 0.9, 0.015), ("signsgd", 0.9, None), ("allreduce", 0.9, None),
    ("dgc", 0.9, None), ("dgc:momentum=0.9", 0.9, 0.1), ("dgc:momentum=0.9", 0.0, None),
    ("dgc:momentum=0.5", 0.9, 0.5), ("topk", 0.9, None)])
def test_lr_factor_is_machine_readable(label: str, momentum: float,
                                       factor: float | None) -> None:
    note = choose.lr_note(choose.make(label), [_sgd(momentum)])
    assert (note and note.factor) == factor
    if note is not None:
        assert f"{factor:g}" in note.message("x")


def test_flags_survive_wrappers_and_mark_the_table() -> None:
    algo = hx.algorithms.get("signsgd", scaled=False, delay=1)  # wrapped: still flagged
    flags = choose.lr_flags([("pure", algo), ("allreduce", choose.make("allreduce"))])
    assert flags == {"pure": "needs lr x0.015"}
    preds = [Prediction(label=label, step_s=s, compute_s=0.1, compress_s=0.0, exposed_s=s - 0.1,
                        wire_bytes=1000, bucket_bytes=1 << 20)
             for label, s in (("pure", 0.2), ("allreduce", 0.3))]
    table = choose.format_table(preds, "allreduce", "fastest drop-in", flags=flags)
    assert "| pure (excluded: needs lr x0.015) |" in table
    assert "| allreduce **<- chosen** |" in table


def _auto(candidates: list[str]) -> dict[str, Any]:
    hx.init()
    net = nn.Linear(64, 32)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    algo = AutoAlgorithm(AutoConfig(candidates=tuple(candidates), probe_budget_s=0.5,
                                    verbose=False, profile_steps=2, tune_buckets=1))
    try:
        model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)
    except ConfigError as e:
        return {"error": str(e)}
    for step in range(4):
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
        opt.zero_grad()
    out = {"label": algo.label, "table": algo.table,
           "excluded": (algo.decision or {}).get("excluded")}
    model.close()
    return out


@pytest.fixture(scope="module")
def auto_runs() -> list[dict[str, Any]]:
    cases = [["signsgd:scaled=false", "allreduce"], ["signsgd:scaled=false"]]
    return [run_local(_auto, 2, args=(c,), timeout=120)[0] for c in cases]


def test_auto_never_picks_a_candidate_needing_another_lr(
        auto_runs: list[dict[str, Any]]) -> None:
    run, only = auto_runs
    assert run["label"] == "allreduce"
    assert run["excluded"] == {"signsgd:scaled=false": "needs lr x0.015"}
    assert "signsgd:scaled=false (excluded: needs lr x0.015)" in run["table"], run["table"]
    assert "needs lr x0.015" in only["error"] and "'allreduce'" in only["error"]
