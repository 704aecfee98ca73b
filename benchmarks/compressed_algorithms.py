"""Wire bytes per step and step time of every compressed algorithm next to allreduce.

One run: N local ranks (gloo over loopback), an MLP on Fashion-MNIST-shaped random batches,
each algorithm in turn on the same model and data. Per algorithm it reports the bytes rank 0
sent per step (the Communicator's counters, ``model.bytes_sent()``), the ratio to allreduce,
and the median step time (forward + backward with communication + optimizer step).

Loopback is not a network: step times here measure compression overhead on the CPU, not the
savings on a slow link (for those, multiply wire bytes by a link's bandwidth, or use the
network lab). Compare times only within one run.

With ``--digits`` it instead trains a 64-64-10 MLP on scikit-learn's digits on 2 ranks with
every algorithm (the settings of tests/test_algo_compressed.py: 20 epochs, lr / 10 after 15,
per-method learning rates) and prints the test accuracy next to allreduce's.

Usage:
    .venv/bin/python benchmarks/compressed_algorithms.py [--world 4] [--steps 20]
        [--hidden 1024] [--layers 2] [--batch 64] [--algorithms topk,gtopk,...]
    .venv/bin/python benchmarks/compressed_algorithms.py --digits [--granularity bucket]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from typing import Any

import torch
from torch import nn

from hexagram.launch import run_local

DEFAULT = [
    ("allreduce", {}), ("fp16", {}), ("bytegrad", {}), ("qsgd", {}), ("terngrad", {}),
    ("onebit", {}), ("efsign", {}), ("signsgd", {}), ("topk", {"density": 0.01}),
    ("gtopk", {"density": 0.01}), ("dgc", {"density": 0.01}), ("randomk", {"density": 0.01}),
    ("powersgd", {"rank": 2, "start_iter": 0}),
]


def _one(name: str, config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import hexagram as hx
    from hexagram.bench.loop import Loop, train_step
    from hexagram.models.mlp import mlp

    rt = hx.get_runtime()
    torch.manual_seed(0)
    net = mlp(784, args.hidden, args.layers, 10)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(name, **config))
    gen = torch.Generator().manual_seed(rt.rank)
    x = torch.rand(args.batch, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    loop, sent = Loop(step=train_step(model, opt, nn.functional.cross_entropy)), 0
    for step in range(args.warmup + args.steps):
        torch.distributed.barrier()
        before = model.bytes_sent()
        loop.run(x, y)
        if step >= args.warmup:
            sent += model.bytes_sent() - before
    model.close()
    return {"bytes": sent / args.steps, "time": statistics.median(loop.times[args.warmup:]),
            "params": sum(p.numel() for p in net.parameters())}


# (algorithm, config, lr, optimizer momentum) for the digits runs
DIGITS: list[tuple[str, dict[str, Any], float, float]] = [
    ("allreduce", {}, 0.1, 0.9), ("fp16", {}, 0.1, 0.9), ("bytegrad", {}, 0.1, 0.9),
    ("qsgd", {}, 0.1, 0.9), ("terngrad", {}, 0.1, 0.9), ("onebit", {}, 0.05, 0.9),
    ("efsign", {}, 0.05, 0.9), ("signsgd", {}, 0.0015, 0.9), ("topk", {"density": 0.1}, 0.1, 0.9),
    ("gtopk", {"density": 0.1}, 0.1, 0.9),
    ("dgc", {"density": 0.1, "warmup_steps": 40, "momentum": 0.9, "masking": True}, 0.2, 0.0),
    ("randomk", {"density": 0.5}, 0.05, 0.9), ("randomk", {"density": 0.25}, 0.05, 0.9),
    ("powersgd", {"rank": 2, "start_iter": 10}, 0.1, 0.9),
]


def _digits_one(name: str, config: dict[str, Any], lr: float, momentum: float,
                epochs: int = 20, batch: int = 32) -> dict[str, float]:
    import hexagram as hx
    from hexagram.bench.loop import train_step
    from hexagram.data import load, shard
    from hexagram.models.mlp import mlp

    rt = hx.get_runtime()
    ds = load("digits")
    x, y = shard(ds.x_train, ds.y_train, rt.rank, rt.world_size)
    torch.manual_seed(0)
    net = mlp(64, 64, 1, 10)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [epochs * 3 // 4], gamma=0.1)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(name, **config))
    step, steps = train_step(model, opt, nn.functional.cross_entropy), 0
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(y) - batch + 1, batch):
            idx = order[start:start + batch]
            step(x[idx], y[idx])
            steps += 1
        sched.step()
    with torch.no_grad():
        acc = float((net(ds.x_test).argmax(1) == ds.y_test).float().mean()) * 100
    result = {"acc": acc, "bytes": model.bytes_sent() / steps}
    model.close()
    return result


def _digits_cases(granularity: str) -> list[tuple[str, dict[str, Any], float, float]]:
    """DIGITS, or with ``granularity`` set on every algorithm where it matters."""
    if not granularity:
        return DIGITS
    elementwise = ("allreduce", "fp16", "signsgd")
    return [DIGITS[0]] + [(n, {**c, "granularity": granularity}, lr, m)
                          for n, c, lr, m in DIGITS if n not in elementwise]


def _digits_worker(granularity: str) -> list[dict[str, float]]:
    import hexagram as hx

    hx.init()
    return [_digits_one(*case) for case in _digits_cases(granularity)]


def digits(granularity: str) -> None:
    """Accuracy on digits per algorithm (2 ranks), next to allreduce's."""
    print(f"machine: {_machine()}")
    print("settings: 2 ranks, MLP 64-64-10 on digits (1348 train / 449 test), batch 32/rank, "
          "20 epochs, SGD with lr / 10 after 15, bucket 25 MiB")
    results = run_local(_digits_worker, 2, args=(granularity,), timeout=1800)[0]
    ref = results[0]["acc"]
    print("\n| algorithm | config | lr, momentum | test accuracy (%) | vs allreduce "
          "| wire bytes/step |")
    print("|---|---|---|---:|---:|---:|")
    for (name, config, lr, momentum), r in zip(_digits_cases(granularity), results):
        print(f"| {name} | {config or ''} | {lr}, {momentum} | {r['acc']:.2f} | "
              f"{r['acc'] - ref:+.2f} | {r['bytes']:,.0f} |")


def _worker(cases: list[tuple[str, dict[str, Any]]], args: argparse.Namespace
            ) -> dict[str, dict[str, Any]]:
    import hexagram as hx

    hx.init()
    return {name: _one(name, config, args) for name, config in cases}


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs, load {load:.1f}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--algorithms", default="", help="comma-separated subset (default: all)")
    p.add_argument("--digits", action="store_true", help="accuracy on digits instead")
    p.add_argument("--granularity", default="", choices=["", "layer", "bucket"],
                   help="with --digits: force this granularity (default: each one's own)")
    args = p.parse_args()
    if args.digits:
        digits(args.granularity)
        return
    chosen = set(args.algorithms.split(",")) if args.algorithms else None
    cases = [(n, c) for n, c in DEFAULT if chosen is None or n in chosen or n == "allreduce"]
    print(f"machine: {_machine()}")
    print(f"settings: world={args.world} (gloo, loopback, 1 thread/rank), MLP 784-"
          f"{args.hidden}x{args.layers}-10, batch {args.batch}/rank, {args.warmup} warm-up + "
          f"{args.steps} timed steps, bucket 25 MiB, configs {dict(cases)}")
    results = run_local(_worker, args.world, args=(cases, args), timeout=1800)[0]
    base = results["allreduce"]
    print(f"parameters: {base['params']:,} ({base['params'] * 4 / 2**20:.2f} MiB float32)\n")
    print("| algorithm | config | wire bytes/step (rank 0) | vs allreduce | step time (ms) |")
    print("|---|---|---:|---:|---:|")
    for name, config in cases:
        r = results[name]
        print(f"| {name} | {config or ''} | {r['bytes']:,.0f} | {r['bytes'] / base['bytes']:.4f}"
              f" | {r['time'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()
