"""A normal end is a clean exit: scripts that never call ``close()`` exit with code 0.

PyTorch DDP needs no ``close()``; Hexagram's wrapper must not either, whatever the
algorithm (the async one runs a background thread inside collectives), also after
``dist.destroy_process_group()`` and when a wrapper is garbage-collected mid-script (then
its threads stop and its hooks are gone). Each case runs two real processes (not
``run_local``, whose ranks shut down cleanly for the script) and checks both exit codes
and that every rank reached the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hexagram.launch import free_port

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent("""
    import gc, sys, threading
    import torch, torch.distributed as dist
    import hexagram as hx
    from _every_algorithm import small_model, train_steps

    mode = sys.argv[1]
    rt = hx.init(timeout=60)
    names = hx.algorithms.names() if mode == "all" else ["async"]
    keep = [train_steps(n, small_model(), rt.device, bucket_size_mb=0.001) for n in names]
    if mode == "destroy":
        dist.destroy_process_group()
    if mode == "all":  # one more async wrapper, dropped mid-script: collected, released
        dropped = train_steps("async", small_model(), rt.device)
        module, threads = dropped.module, threading.active_count()
        del dropped
        gc.collect()
        assert threading.active_count() < threads, "async thread survived garbage collection"
        module(torch.randn(2, 16)).sum().backward()  # hooks detached: purely local
    print(f"END rank {rt.rank}: {len(names)} algorithm(s), no close()", flush=True)
""")


def _run_pair(tmp_path: Path, mode: str) -> list[subprocess.CompletedProcess[str]]:
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    procs = [subprocess.Popen([sys.executable, str(script), mode], text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(2)]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done


@pytest.mark.parametrize("mode", ["all", "destroy"])
def test_script_without_close_exits_zero_on_every_rank(tmp_path: Path, mode: str) -> None:
    results = _run_pair(tmp_path, mode)
    for rank, r in enumerate(results):
        assert r.returncode == 0, (f"rank {rank} exited with {r.returncode} ({mode}):\n"
                                   f"{r.stdout}\n{r.stderr[-3000:]}")
        assert f"END rank {rank}" in r.stdout
        assert "hexagram: releasing" not in r.stderr, r.stderr[-3000:]
