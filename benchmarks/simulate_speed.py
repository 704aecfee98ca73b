"""How long ``hexagram simulate`` takes: all registered algorithms at 8, 64, 512 and 4096
devices, payloads sized from formulas (the simulator's way) or by compressing random tensors
(the way before ``hexagram.cost.payload_size``), each case in a fresh process.

A fresh process per case, because sizes are cached per process: the first call is what a
user of the CLI waits for. Reported per case: the CPU seconds of ``import hexagram`` and of
the first and second ``simulate()`` call (CPU time, not wall time: on a loaded machine wall
time measures the load). Cases alternate ``--repeat`` times; the median is printed.

    .venv/bin/python benchmarks/simulate_speed.py --repeat 3
    .venv/bin/python benchmarks/simulate_speed.py --case mlp analytic   # one run, raw
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

MODELS = ("mlp", "gpt")
SIZING = ("analytic", "compressed")
WORLDS = [8, 64, 512, 4096]


def one(model: str, sizing: str) -> dict[str, float]:
    """Import, then two ``simulate()`` calls of every registered algorithm; CPU seconds."""
    t0 = time.process_time()
    from hexagram.algorithms import registry
    from hexagram.algorithms.labels import simulable
    from hexagram.auto.simulate import simulate
    from hexagram.cost.devices import device
    from hexagram.cost.simulate import Cluster, _simulate, device_compute, reference_tensors

    t1 = time.process_time()
    if model == "gpt":  # the 1.2 B GPT of docs/benchmarks/simulate.md
        tensors, tokens = reference_tensors("gpt", layers=24, width=2048, block=1024)
        compute = device_compute(tensors, device("h100"), samples=8, tokens=tokens)
    else:  # the CLI's default: the 6.3 M-parameter MLP, 32 samples
        tensors, tokens = reference_tensors("mlp")
        compute = device_compute(tensors, device("h100"), 32, tokens)
    args = (registry.names(), WORLDS, compute, Cluster(devices_per_host=8, inter="25gbe"),
            device("h100"), 25.0, None)
    def run() -> list[Any]:  # _simulate alone compresses
        return simulate(*args) if sizing == "analytic" else _simulate(*args, simulable)

    t2 = time.process_time()
    rows = run()
    t3 = time.process_time()
    run()
    t4 = time.process_time()
    return {"import_s": t1 - t0, "first_s": t3 - t2, "second_s": t4 - t3,
            "rows": float(len(rows))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--case", nargs=2, metavar=("MODEL", "SIZING"), default=None)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(one(*args.case)))
        return
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.repeat):
        for model in MODELS:
            for sizing in SIZING:
                out = subprocess.run([sys.executable, __file__, "--case", model, sizing],
                                     check=True, capture_output=True, text=True).stdout
                runs.setdefault((model, sizing), []).append(json.loads(out.splitlines()[-1]))
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (2 cores); median of "
          f"{args.repeat} fresh processes, CPU seconds\n")
    print("| model | payload sizing | rows | import hexagram | first simulate() | second |")
    print("|---|---|---|---|---|---|")
    for (model, sizing), rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"| {model} | {sizing} | {med['rows']:.0f} | {med['import_s']:.2f} | "
              f"{med['first_s']:.2f} | {med['second_s']:.3f} |")


if __name__ == "__main__":
    main()
