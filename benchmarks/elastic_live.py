"""Live mode: per-step overhead without failures, stall per failure, healing time.

3 ranks on gloo (one host), the float64 MLP of ``hexagram.bench.live``:

- overhead: median step time of ``hx.elastic.live`` (quorum vote per step) against the
  plain ``hx.DistributedDataParallel`` loop, same model, data and algorithm;
- failures: replica 2 SIGKILLed at step 30 and restarted; the survivors' stall (abort
  decision to training again, heartbeat timeout included), the returning replica's
  healing time, and the checks (no committed step lost, identical final parameters).

Run: ``PYTHONPATH=. python benchmarks/elastic_live.py --steps 200 --runs 3``. Timings on a
shared machine are noisy; the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hexagram.bench.live import _optimizer, batch, net, run_live
from hexagram.bench.loop import Loop, train_step
from hexagram.launch import run_local


def _plain(steps: int, algorithm: str) -> float:
    """Median step time (s) of the plain wrapper on this rank."""
    import torch.distributed as dist

    import hexagram as hx

    hx.init(timeout=30)
    module = net()
    opt = _optimizer(module)
    model = hx.DistributedDataParallel(module, optimizers=[opt], algorithm=algorithm)
    loop = Loop(step=train_step(model, opt, nn.functional.mse_loss))  # live mode's loop
    for step in range(steps):
        loop.run(*batch(step, dist.get_rank()))
    model.close()
    return statistics.median(loop.times)


def measure(steps: int, algorithm: str, heartbeat_timeout: float) -> dict[str, Any]:
    plain = max(run_local(_plain, 3, (steps, algorithm), timeout=300))
    quiet = run_live(3, steps, kill="", restart=False, algorithm=algorithm, sleep=0.0,
                     together=0, heartbeat_timeout=heartbeat_timeout)
    live = max(statistics.median(r["times"]) for r in quiet.values())
    failed = run_live(3, steps, kill="2@30", restart=True, algorithm=algorithm, sleep=0.01,
                      heartbeat_timeout=heartbeat_timeout)
    survivors = [failed[0], failed[1]]
    params = [r["params"] for r in failed.values()]
    return {
        "algorithm": algorithm, "steps": steps, "heartbeat_timeout_s": heartbeat_timeout,
        "plain_step_ms": 1000 * plain, "live_step_ms": 1000 * live,
        "overhead_ms": 1000 * (live - plain),
        "stall_s": [s for r in survivors for s in r["stats"]["stall_s"]],
        "heal_s": failed[2]["stats"]["heal_s"],
        "committed_steps_lost": sum(
            [s for s, _ in r["log"]] != list(range(r["step"])) for r in survivors),
        "identical_final_params": all(torch.equal(params[0], p) for p in params),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--algorithms", default="allreduce,powersgd")
    parser.add_argument("--heartbeat-timeout", type=float, default=0.5)
    parser.add_argument("--out", default="benchmarks/results/elastic_live.json")
    args = parser.parse_args()
    rows = [measure(args.steps, name, args.heartbeat_timeout)
            for _ in range(args.runs) for name in args.algorithms.split(",")]
    report = {"note": "noisy: shared 2-core machine, other jobs running", "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
