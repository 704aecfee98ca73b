"""Each GPT-2 example runs under ``torchrun --nproc-per-node 2`` (a few steps) and reports a
finite, decreasing-ready loss line; skipped with a reason where a framework is missing."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each example starts 2 ranks that import transformers

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # example -> (framework module it needs, algorithm and config it runs with)
    "gpt2_plain.py": ("transformers", ["--algorithm", "powersgd", "--config", "rank=2"]),
    "gpt2_lightning.py": ("lightning", ["--algorithm", "local_sgd", "--config", "period=2"]),
    "gpt2_accelerate.py": ("accelerate", ["--algorithm", "powersgd", "--config", "rank=2"]),
    "gpt2_trainer.py": ("transformers", ["--algorithm", "allreduce"]),
}


@pytest.mark.parametrize("example", sorted(CASES))
def test_example_runs_under_torchrun(example: str, tmp_path: Path) -> None:
    module, extra = CASES[example]
    for needed in {module, "transformers"}:
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"needs the 'integrations' extra ({needed})")
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HEXAGRAM_EXAMPLE_OUT": str(tmp_path),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(ROOT / "examples" / example), "--steps", "3", "--accumulate", "2",
           "--block", "32", "--json", str(out), *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    finally:  # torchrun and its ranks, whatever happened
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-4000:]
    result = json.loads(out.read_text())
    assert len(result["losses"]) == 3
    assert all(1.0 < loss < 6.0 for loss in result["losses"])  # ln(96) = 4.56 at start
    assert result["bytes_per_step"] > 0
