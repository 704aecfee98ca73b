"""Compressor throughput and wire size on a large gradient, next to a plain tensor copy.

For a float32 gradient of ``--numel`` elements (25M by default) on ``--device`` (cpu or
cuda) it measures, for every registered compressor, ``compress`` and ``decompress`` apart
as input bytes per second and as a fraction of those of ``x.clone()`` measured in the same
rounds (the ratio is what stays meaningful on a shared machine), and the wire bytes as a
fraction of fp32. It then compares top-k at 1% density (approximate on the CPU; CUDA takes
the exact ``torch.topk`` itself) with ``torch.topk`` (time and kept mass), and PowerSGD's
compress + decompress of a square matrix with the three matmuls it is made of.
``--device-path`` runs the CPU on the code CUDA takes (no numpy fast paths). ``--fused``
adds, for the formats :mod:`hexagram.compress.kernels` covers, the same measurements with
the fused Triton kernels in place of the eager code (CUDA only): the encoders of
``minmax8``/``minmax4`` and of the sign bits called directly (``efsign``/``onebit`` plus
their header sums, eager), ``qsgd``/``terngrad`` with their stochastic rounding replaced,
and every decoder with the table and affine decoders replaced.

Run: ``.venv/bin/python benchmarks/compress_throughput.py [--numel N] [--rounds R]
[--device cuda] [--fused]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time
from collections.abc import Callable, Iterator
from typing import cast

import torch

import hexagram.compress as hc
from hexagram.compress import chunks, kernels, packing, quantize, sign_blocks, ternary
from hexagram.compress.lowrank import PowerSGDCompressor

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


Row = tuple[str, float, float, float, float, float]


def throughput(x: torch.Tensor, rounds: int) -> list[Row]:
    """(name, compress s, decompress s, compress x copy, decompress x copy, wire fraction)
    per compressor: best times, ratios of the best copy to the best time."""
    comps = {name: hc.get(name, **CONFIGS.get(name, {})) for name in hc.names()}
    payloads = {name: c.compress(x) for name, c in comps.items()}  # also warms up
    for name, c in comps.items():
        c.decompress(payloads[name])
    copy: list[float] = []
    enc: dict[str, list[float]] = {name: [] for name in comps}
    dec: dict[str, list[float]] = {name: [] for name in comps}
    for _ in range(rounds):  # interleaved, so load changes hit copy and compressors alike
        copy.append(timed(x.clone, x.device))
        for name, c in comps.items():
            enc[name].append(timed(lambda c=c: c.compress(x), x.device))
            dec[name].append(timed(lambda c=c, p=payloads[name]: c.decompress(p), x.device))
    best = min(copy)
    rows: list[Row] = [("copy", best, best, 1.0, 1.0, 1.0)]
    for name in comps:
        wire = payloads[name].nbytes / (4 * x.numel())
        rows.append((name, min(enc[name]), min(dec[name]), best / min(enc[name]),
                     best / min(dec[name]), wire))
    return rows


#: formats with fused kernels
FUSED = ("minmax8", "minmax4", "qsgd", "terngrad", "sign", "efsign", "onebit")


@contextlib.contextmanager
def fused_kernels() -> Iterator[None]:
    """The compressors' stochastic rounding and decoders replaced by the fused kernels (as
    they will call them), restored on exit."""
    swaps = [(quantize, "stochastic_codes", kernels.stochastic_codes),
             (ternary, "stochastic_codes", kernels.stochastic_codes),
             (chunks, "decode_table", kernels.decode_table),
             (quantize, "decode_table", kernels.decode_table),
             (quantize, "decode_affine", kernels.decode_affine),
             (sign_blocks, "decode_affine", kernels.decode_affine)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    for owner, name, fn in swaps:
        setattr(owner, name, fn)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def fused_encoder(name: str, c: hc.Compressor, x: torch.Tensor) -> Callable[[], object]:
    """What ``name``'s compress costs on the fused kernels."""
    if name.startswith("minmax"):
        chunk, bits = c.config.chunk_size, c.bits  # type: ignore[attr-defined]
        return lambda: kernels.minmax_encode(x, chunk, bits)
    if name == "sign":
        return lambda: kernels.sign_bits(x)
    if name in ("efsign", "onebit"):  # the bits, and the float64 sums of the header (eager)
        return lambda: (kernels.sign_bits(x), torch.linalg.vector_norm(x, 1, dtype=torch.float64),
                        x.sum(dtype=torch.float64))
    return lambda: c.compress(x)


def fused_throughput(x: torch.Tensor, rounds: int) -> list[Row]:
    """:func:`throughput`'s rows for :data:`FUSED`, on the fused kernels."""
    comps = {name: hc.get(name) for name in FUSED}
    with fused_kernels():
        payloads = {name: c.compress(x) for name, c in comps.items()}
        enc_fn = {name: fused_encoder(name, c, x) for name, c in comps.items()}
        for name, c in comps.items():  # warm up (compiles the kernels)
            enc_fn[name]()
            c.decompress(payloads[name])
        copy: list[float] = []
        enc: dict[str, list[float]] = {name: [] for name in comps}
        dec: dict[str, list[float]] = {name: [] for name in comps}
        for _ in range(rounds):
            copy.append(timed(x.clone, x.device))
            for name, c in comps.items():
                enc[name].append(timed(enc_fn[name], x.device))
                dec[name].append(timed(lambda c=c, p=payloads[name]: c.decompress(p), x.device))
    best = min(copy)
    return [(f"{name} fused", min(enc[name]), min(dec[name]), best / min(enc[name]),
             best / min(dec[name]), payloads[name].nbytes / (4 * x.numel())) for name in comps]


def topk_comparison(x: torch.Tensor, rounds: int) -> tuple[float, float, float]:
    """(torch.topk seconds, top-k compress seconds, kept mass vs exact) at 1%."""
    k = x.numel() // 100
    approx = hc.get("topk", density=0.01, approximate=True)
    exact_t = min(timed(lambda: torch.topk(x.abs(), k, sorted=False), x.device)
                  for _ in range(max(2, rounds // 2)))
    approx_t = min(timed(lambda: approx.compress(x), x.device) for _ in range(rounds))
    exact_mass = float(torch.topk(x.abs(), k, sorted=False).values.double().sum())
    kept = approx.compress(x).tensors[0]
    return exact_t, approx_t, float(kept.abs().double().sum()) / exact_mass


def powersgd_comparison(x: torch.Tensor, rounds: int, rank: int = 4) -> tuple[float, float]:
    """(matmuls seconds, compress + decompress seconds) of rank-``rank`` PowerSGD on ``x``
    as a square-ish matrix; the matmuls: ``M Q``, ``P^T M`` and ``P Q^T``."""
    c = cast(PowerSGDCompressor, hc.get("powersgd", rank=rank))
    m = c.matrix(x)
    p = torch.randn(m.shape[0], rank, device=x.device)
    q = torch.randn(m.shape[1], rank, device=x.device)

    def matmuls() -> object:
        return m @ q, p.t() @ m, p @ q.t()

    c.decompress(c.compress(x))  # warm up (and the warm start)
    mm = min(timed(matmuls, x.device) for _ in range(rounds))
    full = min(timed(lambda: c.decompress(c.compress(x)), x.device) for _ in range(rounds))
    return mm, full


def print_table(rows: list[Row], gb: float) -> None:
    """The rows as a Markdown table (``gb``: GB of input per call)."""
    print(f"| {'compressor':<15} | {'compress ms':>11} | {'GB/s':>6} | {'x clone':>7} | "
          f"{'decompress ms':>13} | {'GB/s':>6} | {'x clone':>7} | {'wire/fp32':>9} |")
    print(f"|{'-' * 17}|{'-' * 13}:|{'-' * 7}:|{'-' * 8}:|{'-' * 15}:|{'-' * 7}:|"
          f"{'-' * 8}:|{'-' * 10}:|")
    for name, te, td, re, rd, wire in rows:
        print(f"| {name:<15} | {te * 1e3:11.3f} | {gb / te:6.2f} | {re:7.2f} | "
              f"{td * 1e3:13.3f} | {gb / td:6.2f} | {rd:7.2f} | {wire:9.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--device-path", action="store_true",
                        help="on the CPU, take the code CUDA takes (no numpy fast paths)")
    parser.add_argument("--fused", action="store_true",
                        help="also time the fused Triton kernels (CUDA)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device_path:
        packing.CPU_FAST_PATHS = False
    device = torch.device(args.device)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)).to(device)
    print(f"machine: {machine()}; device {device}")
    print(f"input: {args.numel:,} float32 elements ({4 * args.numel / 1e6:.0f} MB), "
          f"{args.rounds} interleaved rounds, best of each; GB/s of input"
          f"{'; CPU on the device path' if args.device_path else ''}")
    rows = throughput(x, args.rounds)
    if args.fused and kernels.available(x):
        rows += fused_throughput(x, args.rounds)
    print_table(rows, 4 * x.numel() / 1e9)
    if args.fused and not kernels.available(x):
        print(f"fused kernels: not run, they need CUDA and triton (device {device})")
    exact_t, approx_t, mass = topk_comparison(x, args.rounds)
    print(f"top-k 1%: torch.topk {exact_t * 1e3:.1f} ms, top-k compress (approximate=True) "
          f"{approx_t * 1e3:.1f} ms ({exact_t / approx_t:.2f}x torch.topk's speed), "
          f"kept mass {100 * mass:.2f}% of exact")
    mm, full = powersgd_comparison(x, args.rounds)
    print(f"powersgd rank 4: its three matmuls {mm * 1e3:.1f} ms, compress + decompress "
          f"{full * 1e3:.1f} ms ({full / mm:.2f}x the matmuls)")


if __name__ == "__main__":
    main()
