"""Chaos soak of live mode: generated failures of five kinds in one run, per algorithm.

Per algorithm (PowerSGD with error feedback; SparseLoCo, a weight algorithm with
error-feedback residuals and an anchor), one run with ``--failures`` failures
(:func:`hexagram.bench.chaos.run_chaos`: SIGKILL, SIGSTOP past the heartbeat then
SIGCONT, a slow step, a kill while healing, a kill inside a collective; kinds drawn with
fixed proportions, one event every ``--every`` committed steps, ``--min-size`` replicas
kept) and one failure-free run of the same number of steps. Reported: failures by kind,
committed steps lost, digests compared at every voted commit and every set-up (and
mismatches), goodput (committed steps per second with failures / without) with the
training time each failure cost and the failure-free time between failures (goodput
depends on the failure rate: run it at the rate you expect), the longest stall and the
outer steps a healed replica takes to contribute again.

    python benchmarks/elastic_chaos.py --failures 1000 --every 40 \\
        --json benchmarks/results/elastic_chaos.json

Timings on a shared machine are noisy; say so where they are published.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from hexagram.bench.chaos import ChaosConfig, run_chaos

CONFIGS: dict[str, dict[str, Any]] = {"powersgd": {}, "sparseloco": {"period": 10}}


def _row(algorithm: str, args: argparse.Namespace, failures: int, steps: int = 0
         ) -> dict[str, Any]:
    keep = f"{args.keep}/{algorithm}_{failures}" if args.keep else None
    cfg = ChaosConfig(algorithm=algorithm, config=CONFIGS.get(algorithm, {}),
                      failures=failures, every=args.every, seed=args.seed, steps=steps,
                      tail=args.tail, min_size=args.min_size,
                      heartbeat_timeout=args.heartbeat_timeout, deadline=args.deadline,
                      keep=keep)
    return run_chaos(cfg)


def _goodput(run: dict[str, Any], free: dict[str, Any]) -> dict[str, Any]:
    """Goodput (committed steps per second with failures / without), the seconds of
    training time each failure cost on average, and the failure-free seconds of training
    between two failures (the failure rate, in this model's time)."""
    rate, base, n = run["committed_per_s"], free["committed_per_s"], run["failures_total"]
    if not rate or not base:
        return {"goodput": None, "lost_s_per_failure": None, "work_s_between_failures": None}
    lost = run["steps"] / rate - run["steps"] / base
    return {"goodput": rate / base, "lost_s_per_failure": lost / n if n else None,
            "work_s_between_failures": run["steps"] / base / n if n else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algorithms", default="powersgd,sparseloco")
    parser.add_argument("--failures", type=int, default=1000)
    parser.add_argument("--every", type=int, default=40)
    parser.add_argument("--tail", type=int, default=200)
    parser.add_argument("--free-steps", type=int, default=0,
                        help="steps of the failure-free run (default: as many as the run "
                             "with failures; its rate is steady, so fewer will do)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-size", type=int, default=2)
    parser.add_argument("--heartbeat-timeout", type=float, default=0.25)
    parser.add_argument("--deadline", type=float, default=7200.0)
    parser.add_argument("--json")
    parser.add_argument("--keep", help="a folder for the raw ledgers and events of each run")
    args = parser.parse_args()
    rows = []
    for algorithm in args.algorithms.split(","):
        with_failures = _row(algorithm, args, args.failures)
        free = _row(algorithm, args, 0, steps=args.free_steps or with_failures["steps"])
        rows.append({"algorithm": algorithm, "with_failures": with_failures,
                     "failure_free": free, **_goodput(with_failures, free)})
        print(json.dumps({k: v for k, v in with_failures.items() if k != "settings"},
                         default=str), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "load_average": os.getloadavg(), "args": vars(args), "rows": rows},
                indent=1, default=str))


if __name__ == "__main__":
    main()
