"""Planned models executed on local gloo CPU ranks: measured step time vs. the cost model.

Calibrates a one-host Cluster on this machine (float64 matmul rate, memory bandwidth,
per-operator overhead, gloo allreduce latency and rate), plans a small GPT with a
tensor-parallel, a pipeline and a combined constraint, runs it on 2 and 4 ranks
(1 thread each) and prints the median measured step time next to the plan's prediction.

Run: .venv/bin/python benchmarks/plan_execute.py
"""

from __future__ import annotations

import os
import platform
import statistics

import torch

from hexagram.launch import run_local
from hexagram.parallel.calibrate import calibrated_cluster
from hexagram.parallel.plans import Plan
from hexagram.parallel.verify import ParitySpec, parity_worker

CASES = [(2, "tensor parallel", {"tp": 2}), (2, "pipeline", {"pp": 2, "microbatches": 4}),
         (4, "tensor parallel", {"tp": 4}), (4, "pipeline", {"pp": 4, "microbatches": 4}),
         (4, "pp2 x tp2", {"pp": 2, "tp": 2, "microbatches": 4}),
         (4, "pp2 x dp2", {"pp": 2, "dp": 2, "microbatches": 4})]


def main() -> None:
    torch.set_num_threads(1)  # as each rank runs
    print(f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, "
          f"torch {torch.__version__}; GPT 4 layers, hidden 128, seq 32, vocab 512, batch 16, "
          f"float64, 8 steps (first 2 dropped)")
    clusters = {w: calibrated_cluster(w) for w in (2, 4)}
    for w, c in clusters.items():
        print(f"# calibrated {w} ranks: {c.device_tflops * 1e3:.2f} GFLOP/s, "
              f"{c.memory_gbps:.1f} GB/s, {c.op_overhead_us:.1f} us/op, link "
              f"{c.intra_latency_us:.0f} us + {c.intra_host_gbps:.2f} Gbit/s")
    print("| ranks | plan | shape | predicted ms | measured ms | measured/predicted |")
    print("|---|---|---|---|---|---|")
    for world, name, cons in CASES:
        spec = ParitySpec(model="gpt", layers=4, hidden=128, heads=4, vocab=512, seq=32,
                          batch=16, steps=8, constraints=cons, cluster=clusters[world],
                          reference=False)
        res = run_local(parity_worker, world, args=(spec,), timeout=300)
        plan = Plan.from_json(res[0]["plan"])
        measured = statistics.median(max(r["times"][k] for r in res) for k in range(2, 8))
        print(f"| {world} | {name} | {plan.summary().split(':')[0]} | "
              f"{plan.step_time_s * 1e3:.1f} | {measured * 1e3:.1f} | "
              f"{measured / plan.step_time_s:.2f} |", flush=True)


if __name__ == "__main__":
    main()
