"""Restart under real torchrun: a store prefix per attempt, a deadline on set-up.

A worker dies on torchrun's first attempt; the second attempt must set up its process group
(static and c10d rendezvous, the latter with ``--nnodes 1:2``) and finish with exit code 0.
Without a prefix per attempt, restarted gloo workers read the dead attempt's addresses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hexagram.launch import free_port, run_local

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import os, torch, torch.distributed as dist, hexagram as hx
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rt = hx.init(timeout=20, init_timeout=20)
x = torch.ones(1) * (rt.rank + 1)
dist.all_reduce(x)
if attempt == 0 and rt.rank == 1:
    os._exit(3)                       # dies on the first attempt only
dist.barrier()
print(f"OK rank={rt.rank} attempt={attempt} sum={x.item()}", flush=True)
"""


def torchrun(script: Path, rdzv: str, nnodes: str, timeout: float = 90
             ) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under torchrun on 2 local ranks with one restart allowed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--nnodes", nnodes, "--max-restarts", "1", "--rdzv-backend", rdzv,
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.2",
           "--rdzv-conf", "last_call_timeout=1",  # 1:2 nodes: don't wait 30 s for a 2nd
           str(script)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.mark.slow  # two torchrun launches each (about 10-30 s on the shared 2-core machine)
@pytest.mark.parametrize(("rdzv", "nnodes"), [("static", "1"), ("c10d", "1:2")])
def test_torchrun_restart_succeeds(tmp_path: Path, rdzv: str, nnodes: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = torchrun(script, rdzv, nnodes)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "OK rank=0 attempt=1 sum=3.0" in out and "OK rank=1 attempt=1 sum=3.0" in out
    assert "attempt=0" not in proc.stdout  # the first attempt really failed


def _late_peer_worker(init_timeout: float) -> str:
    import hexagram as hx
    from hexagram.runtime import InitTimeoutError

    if int(os.environ["RANK"]) == 1:
        return "never called init"  # a rank that crashed before set-up
    start = time.monotonic()
    try:
        hx.init(timeout=60, init_timeout=init_timeout)
    except InitTimeoutError as exc:
        return f"{time.monotonic() - start:.1f}|{exc}"
    return "no error"


def test_setup_raises_within_init_timeout_naming_missing_rank() -> None:
    rank0, rank1 = run_local(_late_peer_worker, 2, args=(3.0,), timeout=60)
    seconds, message = rank0.split("|", 1)
    assert "rank(s) [1] of 2 did not arrive within 3 s" in message
    assert float(seconds) < 3.0 + 10  # the deadline, not the 60 s collective timeout
    assert rank1 == "never called init"


def test_call_with_deadline_raises_instead_of_hanging() -> None:
    from datetime import timedelta

    from hexagram.rendezvous import call_with_deadline
    from hexagram.runtime import InitTimeoutError

    start = time.monotonic()
    with pytest.raises(InitTimeoutError, match="stuck connect did not complete within 0 s"):
        call_with_deadline(lambda: time.sleep(30), timedelta(seconds=0.3), "stuck connect")
    assert time.monotonic() - start < 5
    assert call_with_deadline(lambda: 7, timedelta(seconds=5), "quick") == 7
    with pytest.raises(ZeroDivisionError):
        call_with_deadline(lambda: 1 // 0, timedelta(seconds=5), "failing")
