"""The step recorder auto profiles with: ready order, CPU outside communication, bounded
memory over a long run."""

from __future__ import annotations

import time

import torch
from torch import nn

from hexagram.cost.recorder import StepRecorder


def _step(model: nn.Module, rec: StepRecorder, comm_s: float = 0.0) -> None:
    rec.forward_start()
    model(torch.randn(8, 16)).sum().backward()
    with rec.communicating():  # time spent here is not the model's compute
        end = time.thread_time() + comm_s
        while time.thread_time() < end:
            pass
    rec.backward_done()


def test_ready_order_profile_and_bounded_rows() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    rec = StepRecorder(model, list(model.named_parameters()))
    for _ in range(5):
        _step(model, rec)
    profile = rec.profile(3)
    # backward produces the last layer's gradients first
    assert [s.name for s in profile.tensors][:2] in (["2.weight", "2.bias"],
                                                     ["2.bias", "2.weight"])
    assert profile.backward_s >= max(profile.ready_s) - 1e-9 and profile.cpu_s is not None
    for _ in range(3 * StepRecorder.KEEP):
        _step(model, rec)
    assert StepRecorder.KEEP <= len(rec.rows) <= 2 * StepRecorder.KEEP
    rec.close()


def test_cpu_spent_communicating_is_not_compute() -> None:
    model = nn.Linear(16, 4)
    rec = StepRecorder(model, list(model.named_parameters()))
    for _ in range(4):
        _step(model, rec, comm_s=0.02)
    rows = rec.rows[-3:]
    assert all(r.cpu_s < 0.015 for r in rows), [r.cpu_s for r in rows]
    assert all(r.step_s >= 0.02 for r in rows)
    rec.close()
