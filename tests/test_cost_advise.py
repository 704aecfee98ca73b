"""``hexagram advise`` predicts from a probe file and a profiled model (single process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hexagram.bench.task import load_probe, save_probe
from hexagram.cli import main
from hexagram.cost.probe import COLLECTIVES, Fit, NetworkProfile
from hexagram.cost.profile import CompressorCost

FACTORY = '''
import torch
from torch import nn

def factory():
    model = nn.Sequential(nn.Linear(50, 200), nn.ReLU(), nn.Linear(200, 10))
    return model, lambda: (torch.randn(8, 50), torch.randint(0, 10, (8,))), \\
        nn.functional.cross_entropy
'''


@pytest.fixture()
def probe_file(tmp_path: Path) -> Path:
    # 10 Mbit/s: compression must win over allreduce for a 2M-parameter model
    net = NetworkProfile(4, 4, {k: Fit(0.001, 1.25e6) for k in COLLECTIVES})
    costs = {"topk": CompressorCost((1e-4, 1e-9), (1e-4, 1e-9))}
    path = tmp_path / "probe.json"
    save_probe(path, net, costs)
    return path


def test_probe_file_round_trip(probe_file: Path) -> None:
    net, costs = load_probe(probe_file)
    assert net.fits["p2p"] == Fit(0.001, 1.25e6)
    assert costs["topk"].encode(1000) == pytest.approx(1e-4 + 1e-6)


def test_advise_predicts_for_a_reference_model(probe_file: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["advise", "--probe", str(probe_file), "--model", "mlp", "--params",
                 "2000000", "--algorithms", "allreduce,topk,fp16"])
    out = capsys.readouterr().out
    assert code == 0
    for label in ("allreduce", "topk", "fp16"):
        assert f"| {label}" in out
    assert "topk **<- chosen**" in out  # 0.02 of the bytes at 10 Mbit/s
    assert "recommendation: algorithm=hx.algorithms.get('topk')" in out


def test_advise_module_factory(probe_file: Path, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "my_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["advise", "--probe", str(probe_file), "--module", "my_factory:factory",
                 "--lossless"])
    out = capsys.readouterr().out
    assert code == 0 and "allreduce **<- chosen**" in out and "topk" not in out


def test_advise_from_report_shows_predicted_vs_measured(
        probe_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"algorithm": "ddp", "step_s": 4.0, "efficiency": 0.9},
            {"algorithm": "allreduce", "step_s": 3.9, "efficiency": 0.9},
            {"algorithm": "topk", "step_s": 0.5, "efficiency": 0.5}]
    report = {"settings": {"model": "mlp", "params": 200000, "hosts": 4}, "results":
              {"10mbit": rows}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report))
    assert main(["advise", "--from", str(path), "--probe", str(probe_file)]) == 0
    out = capsys.readouterr().out
    assert "10mbit: use topk" in out
    assert "predicted against measured" in out
    assert "| allreduce |" in out and "| topk |" in out and "| ddp |" not in out
