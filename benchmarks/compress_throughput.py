"""Compressor throughput and wire size on a large gradient, next to a plain tensor copy.

For a float32 gradient of ``--numel`` elements (25M by default) it measures, for every
registered compressor, the time of ``decompress(compress(x))`` as GB/s of input and as a
fraction of the throughput of ``x.clone()`` measured in the same rounds (the ratio is what
stays meaningful on a shared machine), and the wire bytes as a fraction of fp32. It then
compares approximate top-k at 1% density with ``torch.topk`` (time and kept mass).

Run: ``.venv/bin/python benchmarks/compress_throughput.py [--numel N] [--rounds R]``
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

import hexagram.compress as hc

__all__ = ["main"]

# approximate top-k; a threshold that keeps about 1% of N(0, 1) entries (|x| >= 2.576)
CONFIGS: dict[str, dict[str, object]] = {"topk": {"approximate": True},
                                         "threshold": {"threshold": 2.576}}


def machine() -> str:
    """One line describing the machine and its load."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, load average {load:.1f}")


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call (synchronizing the device before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _roundtrip(c: hc.Compressor, x: torch.Tensor) -> Callable[[], object]:
    return lambda: c.decompress(c.compress(x))


def throughput(x: torch.Tensor, rounds: int) -> list[tuple[str, float, float, float, float]]:
    """(name, best seconds, best ratio to copy, median ratio, wire fraction) per compressor."""
    comps = {name: hc.get(name, **CONFIGS.get(name, {})) for name in hc.names()}
    times: dict[str, list[float]] = {name: [] for name in ["copy", *comps]}
    for c in comps.values():  # warm up (allocations, first-call costs)
        c.decompress(c.compress(x))
    for _ in range(rounds):  # interleaved, so load changes hit copy and compressors alike
        times["copy"].append(timed(x.clone, x.device))
        for name, c in comps.items():
            times[name].append(timed(_roundtrip(c, x), x.device))
    copy = times["copy"]
    rows = [("copy", min(copy), 1.0, 1.0, 1.0)]
    for name, c in comps.items():
        ratios = [tc / t for tc, t in zip(copy, times[name])]
        wire = c.compress(x).nbytes / (4 * x.numel())
        rows.append((name, min(times[name]), min(copy) / min(times[name]),
                     statistics.median(ratios), wire))
    return rows


def topk_comparison(x: torch.Tensor, rounds: int) -> tuple[float, float, float]:
    """(torch.topk seconds, approximate compress seconds, kept mass vs exact) at 1%."""
    k = x.numel() // 100
    approx = hc.get("topk", density=0.01, approximate=True)
    exact_t = min(timed(lambda: torch.topk(x.abs(), k, sorted=False), x.device)
                  for _ in range(max(2, rounds // 2)))
    approx_t = min(timed(lambda: approx.compress(x), x.device) for _ in range(rounds))
    exact_mass = float(torch.topk(x.abs(), k, sorted=False).values.double().sum())
    kept = approx.compress(x).tensors[0]
    return exact_t, approx_t, float(kept.abs().double().sum()) / exact_mass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)).to(device)
    print(f"machine: {machine()}; device {device}")
    print(f"input: {args.numel:,} float32 elements ({4 * args.numel / 1e6:.0f} MB), "
          f"{args.rounds} interleaved rounds, compress + decompress")
    print(f"{'compressor':>10} {'ms':>9} {'GB/s':>7} {'x copy':>7} {'(median)':>9} "
          f"{'wire/fp32':>10}")
    for name, t, ratio, median, wire in throughput(x, args.rounds):
        print(f"{name:>10} {t * 1e3:9.1f} {4 * x.numel() / t / 1e9:7.2f} {ratio:7.2f} "
              f"{median:9.2f} {wire:10.4f}")
    exact_t, approx_t, mass = topk_comparison(x, args.rounds)
    print(f"top-k 1%: torch.topk {exact_t * 1e3:.1f} ms, approximate compress "
          f"{approx_t * 1e3:.1f} ms ({exact_t / approx_t:.1f}x faster), "
          f"kept mass {100 * mass:.2f}% of exact")


if __name__ == "__main__":
    main()
