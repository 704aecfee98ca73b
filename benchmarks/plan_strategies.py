"""Planner vs hand-made strategies, all priced by the same cost model.

For an MLP stack and GPT models of 12 to 48 layers on 1x8, 2x8 and 4x8 clusters (A100-like
devices: 80 GB, 150 TFLOP/s achievable, NVLink 2400 Gbit/s, 200 Gbit/s per host), print the
planner's predicted step time next to data parallel, ZeRO-3, tensor parallel in a host,
pipeline only and the best 3D combination, and the planning time.

Run: .venv/bin/python benchmarks/plan_strategies.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from hexagram.parallel import Cluster, baselines, capture, gpt, mlp_stack, plan_graph
from hexagram.parallel.graph import ModelGraph

MODELS = {  # name -> (builder, batch)
    "MLP-16 h8192": (lambda: mlp_stack(layers=16, hidden=8192, in_features=8192,
                                       classes=1000, device="meta"), 256, "mlp"),
    "GPT-12 h1024": (lambda: gpt(layers=12, hidden=1024, heads=16, device="meta"), 128, "gpt"),
    "GPT-24 h2048": (lambda: gpt(layers=24, hidden=2048, heads=16, device="meta"), 64, "gpt"),
    "GPT-48 h1024": (lambda: gpt(layers=48, hidden=1024, heads=16, device="meta"), 128, "gpt"),
    "GPT-48 h4096": (lambda: gpt(layers=48, hidden=4096, heads=32, device="meta"), 64, "gpt"),
}
#: (hosts x devices, inter-host Gbit/s): InfiniBand-class 200 Gbit/s, and 25 Gbit/s Ethernet
CLUSTERS = [("1x8", 200.0), ("2x8", 200.0), ("4x8", 200.0), ("4x8", 25.0)]


def _graph(name: str) -> tuple[ModelGraph, float]:
    """The captured model and the capture seconds."""
    start = time.perf_counter()
    build, batch, kind = MODELS[name]
    shape = (batch, 1024) if kind == "gpt" else (batch, 8192)
    x = torch.zeros(*shape, dtype=torch.long if kind == "gpt" else torch.float32,
                    device="meta")
    return capture(build(), x), time.perf_counter() - start


def _cell(p: object) -> str:
    return "no fit" if p is None else f"{p.step_time_s * 1e3:.1f}"  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="GPT-12 on 1x8 and 2x8 only")
    args = parser.parse_args()
    print(f"# machine: {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, torch {torch.__version__}")
    models = ["GPT-12 h1024"] if args.quick else list(MODELS)
    clusters = CLUSTERS[:2] if args.quick else CLUSTERS
    print("# clusters: 80 GB, 150 TFLOP/s, 1500 GB/s per device; 2400 Gbit/s inside a host; "
          "step times in ms predicted by the cost model (bf16, Adam: 16 B/parameter)")
    head = ["model", "cluster", "planner ms", "DP", "ZeRO-3", "TP(host)", "PP only",
            "best 3D", "best / planner", "plan", "capture+plan s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in models:
        graph, captured = _graph(name)
        for spec, inter in clusters:
            cluster = Cluster.parse(spec, intra_host_gbps=2400, inter_host_gbps=inter,
                                    device_memory_gb=80, device_tflops=150)
            label = f"{spec} {inter:g}G"
            start = time.perf_counter()
            try:
                p = plan_graph(graph, cluster)
            except MemoryError as exc:
                print(f"| {name} | {label} | no fit: {exc} |")
                continue
            took = time.perf_counter() - start + captured
            base = [b.plan for b in baselines(graph, cluster)]
            found = [b.step_time_s for b in base if b is not None]
            ratio = f"{min(found) / p.step_time_s:.2f}x" if found else "only plan"
            cells = [name, label, f"{p.step_time_s * 1e3:.1f}", *map(_cell, base), ratio,
                     p.summary().split(":")[0], f"{took:.1f}"]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
