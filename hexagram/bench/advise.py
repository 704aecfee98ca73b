"""``hexagram advise``: recommend an algorithm for a measured network.

Either reads a ``hexagram bench --json`` report, or measures now (same options as
``hexagram bench``), then names, for each bandwidth, the fastest algorithm that ran without
error and how it compares with PyTorch DDP. Compressed and delayed algorithms change the
optimisation: confirm the choice with ``hexagram train`` (time to accuracy).

Example:
    $ hexagram bench --bandwidth 100mbit,1gbit --algorithms all --json bench.json
    $ hexagram advise --from bench.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hexagram.bench.cli import add_arguments as add_bench_arguments
from hexagram.bench.cli import run_bench
from hexagram.bench.lab import LabUnavailableError

__all__ = ["add_arguments", "recommend", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options: ``--from REPORT.json``, or any ``hexagram bench`` option to measure now."""
    parser.add_argument("--from", dest="source", help="a `hexagram bench --json` report")
    add_bench_arguments(parser)


def recommend(rows: list[dict[str, Any]], min_efficiency: float = 0.0) -> dict[str, Any]:
    """The fastest algorithm of one bandwidth's summaries (errors skipped), with its speed-up
    over ``ddp``; ``min_efficiency`` drops algorithms far from their bound."""
    ok = [r for r in rows if "error" not in r and r["efficiency"] >= min_efficiency]
    if not ok:
        raise ValueError("no algorithm ran successfully in this report")
    best = min(ok, key=lambda r: r["step_s"])
    ddp = next((r for r in ok if r["algorithm"] == "ddp"), None)
    hexagram_rows = [r for r in ok if not r["algorithm"].startswith("ddp")]
    best_hx = min(hexagram_rows, key=lambda r: r["step_s"]) if hexagram_rows else None
    return {"best": best["algorithm"], "best_step_s": best["step_s"],
            "best_hexagram": best_hx["algorithm"] if best_hx else None,
            "speedup_vs_ddp": ddp["step_s"] / best["step_s"] if ddp else None}


def run(args: argparse.Namespace) -> int:
    """Print a recommendation per bandwidth; 2 when the lab is unavailable."""
    if args.source:
        with open(args.source) as f:
            report = json.load(f)
    else:
        try:
            report = run_bench(args)
        except LabUnavailableError as exc:
            print(f"hexagram advise: {exc}", file=sys.stderr)
            return 2
    for bandwidth, rows in report["results"].items():
        advice = recommend(rows)
        speed = (f", {advice['speedup_vs_ddp']:.1f}x the step rate of PyTorch DDP"
                 if advice["speedup_vs_ddp"] else "")
        print(f"{bandwidth}: use {advice['best']} ({advice['best_step_s']:.3f} s/step{speed}); "
              f"fastest Hexagram algorithm: {advice['best_hexagram']}")
    print("Compressed and delayed algorithms change convergence: check time to accuracy "
          "with `hexagram train --algorithms ...` before adopting one.")
    return 0
