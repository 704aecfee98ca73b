"""ZeRO for real: measured per-rank memory of a data-parallel plan, FSDP2-sharded vs. not.

For each (dp, layers): plan an MLP stack (hidden 256, float64, Adam) over ``dp`` local gloo
ranks twice, once for devices too small for replicated training state (the planner marks
every module ``+zero``; FSDP2 shards it) and once for roomy devices (plain data parallel),
run both on the same ranks and report, per rank (the largest over ranks):

- state: bytes of the rank's local parameter + gradient + optimizer-state storages after a
  step (exact, from the storages);
- peak: the state live at the start of a step plus the highest level torch's CPU allocator
  reaches above it during forward + backward + Adam step (``torch.profiler`` memory
  events); activations are under 1% of it (batch 2 per rank).

Run: .venv/bin/python benchmarks/plan_memory.py [--cases 4x4,4x8,4x16]
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

from hexagram.launch import run_local
from hexagram.parallel.memory import MemorySpec, memory_plan, memory_worker

MB = 1e6


def run_case(dp: int, layers: int) -> dict[str, float]:
    """Both plans on ``dp`` ranks; the largest per-rank figures of each."""
    specs = [MemorySpec(dp=dp, layers=layers, zero=z) for z in (True, False)]
    ranks = run_local(memory_worker, dp, args=(specs[0], [memory_plan(s) for s in specs]),
                      timeout=550)
    sharded, full = ([r[k] for r in ranks] for k in (0, 1))
    assert sharded[0]["zero_modules"] and not full[0]["zero_modules"]
    out = {}
    for name, rows in (("zero", sharded), ("full", full)):
        out[f"{name}_state"] = max(r["state_after_step"]["total"] for r in rows) / MB
        out[f"{name}_peak"] = max(r["peak_bytes"] for r in rows) / MB
        out[f"{name}_predicted"] = rows[0]["predicted_bytes"] / MB
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="4x4,4x8,4x16", help="DPxLAYERS,...")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, "
          f"torch {torch.__version__}; MLP stack hidden 256 (4x inner), float64, Adam, "
          f"batch 2 per rank, gloo")
    print("| dp | blocks | params (M) | state MB full | state MB ZeRO-3 | state ratio | "
          "peak MB full | peak MB ZeRO-3 | peak ratio | predicted MB full / ZeRO-3 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        dp, layers = (int(v) for v in case.split("x"))
        r = run_case(dp, layers)
        params = r["full_state"] * MB / 8 / 4 / 1e6  # float64 params, grads, 2 Adam moments
        print(f"| {dp} | {layers} | {params:.2f} | {r['full_state']:.1f} | "
              f"{r['zero_state']:.1f} | {r['zero_state'] / r['full_state']:.3f} | "
              f"{r['full_peak']:.1f} | {r['zero_peak']:.1f} | "
              f"{r['zero_peak'] / r['full_peak']:.3f} | {r['full_predicted']:.1f} / "
              f"{r['zero_predicted']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
