"""``hexagram simulate`` findings: the 4096-device table, the seeds' published figures next
to the simulator's prediction, and the crossovers (docs/benchmarks/simulate.md).

Nothing here runs a network: every figure is a prediction of :mod:`hexagram.cost.simulate`.
Settings the papers do not state (batch sizes, layer profiles, efficiency) are assumptions,
printed with the tables.

    .venv/bin/python benchmarks/simulate_findings.py --part table \
        --plot docs/benchmarks/simulate_gpt1.3b_25gbe.png
    .venv/bin/python benchmarks/simulate_findings.py --part published
    .venv/bin/python benchmarks/simulate_findings.py --part crossovers
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from hexagram.auto.simulate import simulate
from hexagram.bench.simulate_cli import format_rows, plot_rows
from hexagram.cost.devices import EFFICIENCY, device
from hexagram.cost.profile import ComputeProfile
from hexagram.cost.simulate import (
    Cluster,
    Row,
    device_compute,
    params_tensors,
    reference_tensors,
)

GPT_LABELS = ["allreduce", "allreduce:hierarchical=true", "fp16", "powersgd", "qsgd", "topk",
              "gtopk", "local_sgd", "diloco"]


def gpt_compute(dev: str = "h100") -> ComputeProfile:
    """The reference GPT at 1.2 B parameters (24 blocks of width 2048, 1024 tokens), 8
    sequences per device."""
    tensors, tokens = reference_tensors("gpt", layers=24, width=2048, block=1024)
    return device_compute(tensors, device(dev), samples=8, tokens=tokens)


def cnn_compute(params: int, fwd_gflops: float, batch: int, dev: str, layers: int = 16,
                efficiency: float = EFFICIENCY) -> ComputeProfile:
    """A CNN as ``layers`` equal layers of ``params`` with ``fwd_gflops`` forward GFLOPs per
    sample (``device_compute`` counts ``2 N`` forward FLOPs per token: tokens scale it)."""
    tensors = params_tensors(params, layers)
    n = sum(t.numel for t in tensors)
    return device_compute(tensors, device(dev), batch, fwd_gflops * 1e9 / (2 * n), efficiency)


def table(plot: str | None) -> None:
    compute = gpt_compute()
    t0 = time.process_time()
    rows = simulate(GPT_LABELS, [8, 64, 512, 4096], compute,
                    Cluster(devices_per_host=8, inter="25gbe"), device("h100"))
    print(format_rows(rows))
    print(f"\n(simulate() took {time.process_time() - t0:.1f} CPU-s here)")
    if plot:
        plot_rows(rows, plot, "GPT 1.2B on H100, 8 per host, 25 Gbit/s between hosts")


def _step(rows: Sequence[Row], label: str, world: int) -> float | None:
    return next(r.step_s for r in rows if r.label == label and r.world == world)


# (name, parameters, forward GFLOPs per sample, batch per worker): the gTop-k paper's models;
# parameter and FLOP counts are the usual published ones, batch sizes are assumptions.
GTOPK_MODELS = [("VGG-16 (CIFAR-10)", 14_700_000, 0.31, 128),
                ("ResNet-20 (CIFAR-10)", 270_000, 0.041, 32),
                ("AlexNet (ImageNet)", 61_000_000, 0.72, 64),
                ("ResNet-50 (ImageNet)", 25_600_000, 4.1, 32)]


def published_gtopk(efficiency: float = EFFICIENCY) -> None:
    print(f"Efficiency {efficiency} of the P102's FP32 peak\n")
    print("| model | P | S-SGD step s | top-k step s | gTop-k step s | gTop-k / S-SGD | "
          "gTop-k / top-k |\n|---|---|---|---|---|---|---|")
    labels = ["allreduce", "topk:density=0.001", "gtopk:density=0.001"]
    cluster = Cluster(devices_per_host=1, intra="pcie3x4", inter="1gbe", backend="mpi")
    at32 = []
    for name, params, gflops, batch in GTOPK_MODELS:
        compute = cnn_compute(params, gflops, batch, "p102", efficiency=efficiency)
        rows = simulate(labels, [4, 8, 16, 32], compute, cluster, device("p102"))
        for p in (4, 8, 16, 32):
            s, t, g = (_step(rows, lb, p) or 0.0 for lb in labels)
            print(f"| {name} | {p} | {s:.3f} | {t:.3f} | {g:.3f} | {s / g:.2f}x | "
                  f"{t / g:.2f}x |")
            if p == 32:
                at32.append((s / g, t / g))
    print(f"\nMean at P = 32: gTop-k / S-SGD {sum(a for a, _ in at32) / 4:.2f}x, "
          f"gTop-k / top-k {sum(b for _, b in at32) / 4:.2f}x (paper: 6.7x and 1.4x)")


# BAGUA's setting: 16 hosts x 8 V100; two of its workloads, sizes as published, batch assumed
BAGUA_MODELS = [("VGG-16 (ImageNet)", "cnn", 138_000_000, 15.5, 32),
                ("BERT-large (fine-tune)", "lm", 336_000_000, 384, 8)]
# BAGUA's own algorithms (Hexagram's versions), not PowerSGD or 1-bit: like for like
BAGUA_LABELS = ["allreduce", "allreduce:hierarchical=true", "bytegrad", "qadam",
                "decentralized", "low_precision_decentralized"]


def _bagua_compute(kind: str, params: int, size: float, batch: int) -> ComputeProfile:
    if kind == "cnn":
        return cnn_compute(params, size, batch, "v100")
    return device_compute(params_tensors(params, 24), device("v100"), batch, int(size))


def published_bagua() -> None:
    print("| model | link | GPUs | DDP (allreduce) step s | best relaxation | its step s | "
          "speed-up |\n|---|---|---|---|---|---|---|")
    for name, kind, params, size, batch in BAGUA_MODELS:
        compute = _bagua_compute(kind, params, size, batch)
        for inter in ("10gbe", "25gbe", "100gbe"):
            rows = simulate(BAGUA_LABELS, [16, 32, 64, 128], compute,
                            Cluster(devices_per_host=8, intra="nvlink2", inter=inter),
                            device("v100"))
            for p in (16, 128):
                base = _step(rows, "allreduce", p) or 0.0
                best = min((r for r in rows if r.world == p and r.step_s and
                            r.label != "allreduce"), key=lambda r: r.step_s or 0.0)
                print(f"| {name} | {inter} | {p} | {base:.3f} | {best.label} | "
                      f"{best.step_s:.3f} | {base / (best.step_s or 1):.2f}x |")


PAIRS = [("gtopk:density=0.01", "topk:density=0.01"), ("allreduce:hierarchical=true", "allreduce"),
         ("powersgd", "fp16"), ("local_sgd", "allreduce")]


def _runs(worlds: Sequence[int], wins: set[int]) -> str:
    runs: list[list[int]] = []
    for p in worlds:
        if p in wins and runs and runs[-1][-1] == worlds[worlds.index(p) - 1]:
            runs[-1].append(p)
        elif p in wins:
            runs.append([p])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) or "never"


def crossovers() -> None:
    compute, dev = gpt_compute(), device("h100")
    worlds = [2 ** i for i in range(1, 13)]
    labels = sorted({lb for pair in PAIRS for lb in pair})
    print("| inter-host link | " + " | ".join(f"{a} < {b} at P in" for a, b in PAIRS) +
          " |\n|---|" + "---|" * len(PAIRS))
    for inter in ("1gbe", "10gbe", "25gbe", "100gbe", "ib-ndr"):
        rows = simulate(labels, worlds, compute, Cluster(devices_per_host=8, inter=inter), dev)
        cells = []
        for a, b in PAIRS:
            wins = {p for p in worlds if (_step(rows, a, p) or 1e99) < (_step(rows, b, p)
                                                                         or 1e99)}
            cells.append(_runs(worlds, wins))
        print(f"| {inter} | " + " | ".join(cells) + " |")
    print("\nLocal SGD: the shortest period H (steps between weight averages) whose step is "
          "within 10 % of compute alone\n\n| inter-host link | P = 64 | P = 512 | P = 4096 |"
          "\n|---|---|---|---|")
    periods = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    for inter in ("1gbe", "10gbe", "25gbe", "100gbe", "ib-ndr"):
        rows = simulate([f"local_sgd:period={h}" for h in periods], [64, 512, 4096], compute,
                        Cluster(devices_per_host=8, inter=inter), dev)
        cells = []
        for p in (64, 512, 4096):
            ok = [h for h in periods if (_step(rows, f"local_sgd:period={h}", p) or 1e99)
                  <= 1.1 * compute.step_s]
            cells.append(str(ok[0]) if ok else f"> {periods[-1]}")
        print(f"| {inter} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("table", "published", "crossovers"), required=True)
    ap.add_argument("--plot", default=None, help="PNG of the 4096-device table")
    args = ap.parse_args()
    if args.part == "table":
        table(args.plot)
    elif args.part == "published":
        published_gtopk()
        print()
        published_gtopk(0.1)
        print()
        published_bagua()
    else:
        crossovers()


if __name__ == "__main__":
    main()
