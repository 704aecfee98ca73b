"""The table of :mod:`loco_lm` runs over seeds: validation loss against steps and bytes.

Reads one or more ``loco_lm.py --json`` files (for example one per seed), groups the runs
by method and prints a Markdown table: the mean validation loss over the seeds at every
evaluation step, the final loss's mean, standard deviation and per-seed values, the bytes
sent per rank, and the ratios the targets name (bytes against DDP and against DiLoCo at
the same period H; final loss against DDP with the same inner optimizer).

Usage::

    python benchmarks/loco_table.py benchmarks/results/loco/lm_3m_s0_2026-11-27.json \\
        benchmarks/results/loco/lm_3m_s1_2026-11-27.json \\
        benchmarks/results/loco/lm_3m_s2_2026-11-27.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loco_lm import METHODS


def load(paths: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Runs by method, in seed order."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in paths:
        for r in json.loads(Path(path).read_text())["results"]:
            runs[r["method"]].append(r)
    return {m: sorted(rs, key=lambda r: r["seed"]) for m, rs in runs.items()}


def _baseline(method: str) -> str:
    """DDP with the same inner optimizer."""
    return "ddp-sgd" if METHODS[method][2] == "sgd" else "ddp"


def _same_h(method: str) -> str | None:
    """fp32 DiLoCo at the same period, for the other weight methods."""
    algo, cfg, _ = METHODS[method]
    other = f"diloco-H={cfg.get('period')}"
    return other if algo != "allreduce" and other != method and other in METHODS else None


def row(method: str, runs: dict[str, list[dict[str, Any]]]) -> str:
    rs = runs[method]
    finals = [r["curve"][-1]["val"] for r in rs]
    mean = statistics.fmean(finals)
    sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
    sent = rs[0]["curve"][-1]["bytes"]
    steps = [p["step"] for p in rs[0]["curve"]]
    curve = " / ".join(f"{statistics.fmean(r['curve'][i]['val'] for r in rs):.3f}"
                       for i in range(len(steps)))

    def vs_bytes(other: str | None) -> str:
        if other is None or other not in runs:
            return "-"
        return f"{runs[other][0]['curve'][-1]['bytes'] / sent:.1f}x fewer"

    base = _baseline(method)
    vs_ddp = "-" if method == base or base not in runs else vs_bytes(base)
    loss_vs = "-"
    if base in runs and method != base:
        ref = statistics.fmean(r["curve"][-1]["val"] for r in runs[base])
        loss_vs = f"{(mean / ref - 1) * 100:+.1f}%"
    same_h = _same_h(method)
    loss_h = "-"
    if same_h in runs:
        ref_h = statistics.fmean(r["curve"][-1]["val"] for r in runs[same_h])
        loss_h = f"{(mean / ref_h - 1) * 100:+.1f}%"
    seeds = ",".join(str(r["seed"]) for r in rs)
    per_seed = " / ".join(f"{v:.3f}" for v in finals)
    return (f"| {method} | {seeds} | {curve} | {mean:.3f} ({sd:.3f}) | {per_seed} | "
            f"{sent / 1e6:.3f} | {vs_ddp} | {vs_bytes(same_h)} | {loss_vs} | {loss_h} |")


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    first = next(iter(runs.values()))[0]
    steps = " / ".join(str(p["step"]) for p in first["curve"])
    head = (f"| method | seeds | mean val @ {steps} | final val, mean (sd) | per seed | "
            "MB sent / rank | bytes vs its DDP | bytes vs DiLoCo, same H | "
            "final vs its DDP | final vs DiLoCo, same H |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    order = [m for m in METHODS if m in runs]
    return "\n".join([head, *(row(m, runs) for m in order)])


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    runs = load(sys.argv[1:])
    params = next(iter(runs.values()))[0]["params"]
    print(f"GPT of {params:,} parameters; means over the seeds listed\n")
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
