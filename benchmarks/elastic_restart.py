"""Restart benchmark: ``torchrun --max-restarts`` + checkpoints, a rank SIGKILLed mid-run.

Each run launches 2 ranks under real torchrun (static or c10d rendezvous). They train an
MLP in float64 for ``--steps`` steps with ``hexagram.save_checkpoint`` every ``--every``
steps; on the first attempt rank 1 SIGKILLs itself at ``--kill-step``; torchrun restarts the
attempt, which resumes with ``hexagram.load_checkpoint``. The final parameters are compared
bit for bit with an uninterrupted run (same script, no kill).

Example:
    $ python benchmarks/elastic_restart.py --rdzv static,c10d --runs 3 \\
        --algorithm powersgd --json restart.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "run_once", "worker"]


def worker(args: argparse.Namespace) -> None:
    """One rank under torchrun (``--worker``)."""
    import torch
    from torch import nn

    import hexagram as hx
    from hexagram.testing.faults import Fault, FaultInjector

    rt = hx.init(timeout=20, init_timeout=20)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=args.algorithm)
    faults = [Fault(1, args.kill_step, "sigkill")] if args.kill_step >= 0 and attempt == 0 \
        else []
    injector = FaultInjector(faults, rt.rank)
    start = hx.load_checkpoint(args.dir, model, [opt]) or 0
    for step in range(start, args.steps):
        injector.at_step(step)
        g = torch.Generator().manual_seed(1000 * rt.rank + step)
        x = torch.randn(32, 16, generator=g, dtype=torch.float64)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.every == 0:
            hx.save_checkpoint(args.dir, model, [opt], step=step + 1)
    if rt.rank == 0:
        params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        torch.save({"params": params, "attempt": attempt, "start": start}, args.out)
    model.close()


def run_once(rdzv: str, algorithm: str, workdir: Path, kill_step: int, steps: int = 30,
             every: int = 10, timeout: float = 240) -> dict[str, Any]:
    """One torchrun job (2 ranks, 1 restart allowed); its outcome and final parameters."""
    from hexagram.launch import free_port

    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "final.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--nnodes", "1:2" if rdzv == "c10d" else "1", "--max-restarts", "1",
           "--rdzv-backend", rdzv, "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "--rdzv-conf", "last_call_timeout=1", "--monitor-interval", "0.2",
           str(Path(__file__).resolve()), "--worker", "--algorithm", algorithm,
           "--dir", str(workdir / "ckpt"), "--out", str(out), "--steps", str(steps),
           "--every", str(every), "--kill-step", str(kill_step)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    result: dict[str, Any] = {"rdzv": rdzv, "returncode": proc.returncode,
                              "wall_s": round(time.monotonic() - t0, 1)}
    if proc.returncode == 0 and out.exists():
        import torch

        saved = torch.load(out)
        result.update(params=saved["params"], attempt=saved["attempt"], start=saved["start"])
    else:
        result["log_tail"] = (proc.stdout + proc.stderr)[-2000:]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", default="")
    p.add_argument("--out", default="")
    p.add_argument("--rdzv", default="static,c10d")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--algorithm", default="powersgd")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-step", type=int, default=15)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import torch

    rows = []
    with tempfile.TemporaryDirectory(prefix="hexagram-restart-") as tmp:
        ref = run_once("static", args.algorithm, Path(tmp) / "reference", -1, args.steps,
                       args.every)
        for rdzv in args.rdzv.split(","):
            for i in range(args.runs):
                r = run_once(rdzv, args.algorithm, Path(tmp) / f"{rdzv}{i}", args.kill_step,
                             args.steps, args.every)
                r["bitwise"] = "params" in r and "params" in ref and \
                    torch.equal(r.pop("params"), ref["params"])
                r["steps_lost"] = args.kill_step - r["start"] if "start" in r else None
                rows.append(r)
                print(json.dumps(r), flush=True)
    ok = sum(r["returncode"] == 0 and r["attempt"] == 1 and r["bitwise"] for r in rows)
    print(f"{ok} of {len(rows)} restarted runs succeeded with bit-identical parameters "
          f"({args.algorithm}, kill at step {args.kill_step}, checkpoint every {args.every})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ok": ok,
                                               "load": os.getloadavg()}, indent=1))
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
