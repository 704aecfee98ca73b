"""Robust step time against allreduce's on loopback (target: at most 1.5x for the
coordinate-wise aggregators).

Runs ``hexagram bench --loopback`` with allreduce and the robust aggregators, alternating
over ``--rounds`` rounds (the median round is kept, so slow phases of a shared machine hit
every algorithm alike), once per code tree: this checkout, and optionally others (e.g. an
older commit unpacked with ``git archive``) for an A/B of a change. Prints, per tree, the
step time and its ratio to allreduce's in the same run, and writes them as JSON.

Example:
    $ PYTHONPATH=. python benchmarks/robust_step.py --hosts 5 --params 1000000 \\
        --tree . --tree /tmp/before --json benchmarks/results/robust_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

AGGREGATORS = "trimmed_mean,median,krum,centered_clip"


def bench(tree: str, opts: argparse.Namespace) -> list[dict[str, Any]]:
    """One ``hexagram bench`` run with the code of ``tree``; its loopback rows."""
    algos = ["allreduce"] + [f"robust:aggregator={a}" for a in opts.aggregators.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [sys.executable, "-m", "hexagram.cli", "bench", "--loopback",
               "--hosts", str(opts.hosts), "--params", str(opts.params),
               "--algorithms", ",".join(algos), "--steps", str(opts.steps),
               "--warmup", str(opts.warmup), "--rounds", str(opts.rounds), "--quiet",
               "--json", out]
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            report = json.load(f)
    rows: list[dict[str, Any]] = report["results"]["loopback"]
    base = next(r["step_s"] for r in rows if r["algorithm"] == "allreduce")
    return [{"tree": tree, "algorithm": r["algorithm"], "step_s": r["step_s"],
             "rounds_step_s": r.get("rounds_step_s"), "vs_allreduce": r["step_s"] / base,
             "cpu_s": r.get("cpu_s"), "mb_per_step": r["reported_bytes_per_step"] / 1e6,
             "load_average": report["machine"].get("load_average")} for r in rows]


def markdown(rows: list[dict[str, Any]]) -> str:
    """One line per tree x algorithm."""
    lines = ["| tree | algorithm | step (ms, median round) | rounds (ms) | vs allreduce | "
             "CPU/step (s) | MB/step |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        rounds = ", ".join(f"{1000 * s:.0f}" for s in r["rounds_step_s"] or [])
        lines.append(f"| {r['tree']} | {r['algorithm']} | {1000 * r['step_s']:.1f} | {rounds} "
                     f"| {r['vs_allreduce']:.2f}x | {r['cpu_s']:.3f} | {r['mb_per_step']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--hosts", type=int, default=5)
    a("--params", type=int, default=1_000_000)
    a("--aggregators", default=AGGREGATORS)
    a("--steps", type=int, default=30)
    a("--warmup", type=int, default=3)
    a("--rounds", type=int, default=3)
    a("--tree", action="append", default=[], help="code tree to measure (repeatable; "
      "default: this checkout)")
    a("--json", required=True)
    opts = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for tree in opts.tree or ["."]:
        print(f"== {tree}", file=sys.stderr, flush=True)
        rows += bench(tree, opts)
        with open(opts.json, "w") as f:
            json.dump({"settings": vars(opts), "rows": rows}, f, indent=1)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
