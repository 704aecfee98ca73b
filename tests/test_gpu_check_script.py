"""``scripts/gpu_check.py`` (``make gpu-check``) skips cleanly without CUDA.

On a machine without CUDA the script must still run with a bare interpreter and
``PYTHONPATH=.``, write its report and exit 0, saying why each part was skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the gpu tier "
                    "runs the script's parts instead")
def test_smoke_without_cuda_reports_skipped_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "report"
    env = dict(os.environ, PYTHONPATH=".")
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "skipped: no CUDA" in done.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["parts"]["smoke"]["status"].startswith("skipped: no CUDA")
    assert "skipped: no CUDA" in (out / "gpu_check.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the gpu tier "
                    "runs the script's parts instead")
def test_model_and_profile_parts_without_cuda_report_skipped(tmp_path: Path) -> None:
    out = tmp_path / "report"
    env = dict(os.environ, PYTHONPATH=".")
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "model", "profile",
                           "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    parts = json.loads((out / "gpu_check.json").read_text())["parts"]
    assert set(parts) == {"model", "profile"}
    assert all(p["status"].startswith("skipped: no CUDA") for p in parts.values()), parts


# -- the model and profile parts' steps, run on a CPU rank with small models ----------------
SCRIPTS = str(ROOT / "scripts")
if SCRIPTS not in sys.path:  # the ranks import the steps module by name, as the script's do
    sys.path.insert(0, SCRIPTS)

#: the setups that need care: momentum (decoupled_momentum), its own optimizer (qadam),
#: a period (diloco), a warm-up (powersgd)
FEW = ["allreduce", "fp16", "powersgd", "decoupled_momentum", "qadam", "diloco"]


def test_model_worker_times_every_setup_against_torch_ddp_on_cpu() -> None:
    import gpu_check_steps as steps

    from hexagram.launch import run_local

    out = run_local(steps.time_models, 1, args=(FEW, 200.0, "tiny"), timeout=240)[0]
    halves = ["mlp"]
    try:
        import transformers  # noqa: F401
        halves.append("gpt2")
    except ImportError:
        assert out["gpt2"]["status"].startswith("skipped: transformers is not importable")
    for half in halves:
        rows = out[half]["setups"]
        assert list(rows) == ["no wrapper", "torch DDP", *FEW]
        for label, row in rows.items():
            assert isinstance(row, dict), f"{half} {label}: {row}"
            assert 0 < row["median_ms"] <= row["max_ms"] and row["peak_gib"] is None
        assert rows["torch DDP"]["x_ddp"] == 1.0
    table = steps.model_markdown(out)
    assert "| decoupled_momentum |" in table and "x torch DDP" in table


def test_profile_worker_reports_top_ops_per_setup_on_cpu() -> None:
    import gpu_check_steps as steps

    from hexagram.launch import run_local

    out = run_local(steps.profile_setups, 1, args=(["allreduce", "fp16"], 100.0, "tiny"),
                    timeout=180)[0]
    rows = out["setups"]
    assert list(rows) == ["no wrapper", "torch DDP", "allreduce", "fp16"]
    for label, row in rows.items():
        assert isinstance(row, dict), f"{label}: {row}"
        assert 0 < len(row["by_cpu"]) <= steps.TOP and row["by_cuda"] == []
        assert any(op["op"] == "aten::addmm" for op in row["by_cpu"]), row["by_cpu"]
        assert row["syncs"] is None  # counted on CUDA only
    table = steps.profile_markdown(out)
    assert "| fp16 |" in table and "by CPU time: `" in table


def test_a_setup_past_the_time_limit_is_reported_skipped() -> None:
    import gpu_check_steps as steps

    rows = steps._each(["a", "b"], lambda label: {"label": label}, deadline=0.0)
    assert rows == {"a": "skipped: the part's time limit was reached",
                    "b": "skipped: the part's time limit was reached"}
