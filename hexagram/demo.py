"""``hexagram demo``: data-parallel training on real data with a few local ranks.

Part 1 trains an MLP on Fashion-MNIST (scikit-learn's digits where the Debian package is
missing) with each chosen algorithm on local ranks over loopback, and prints accuracy,
throughput and the bytes each rank sent. Part 2, when the network lab can run (root, ``ip``
and ``tc``), compares PyTorch DDP with Hexagram algorithms on emulated hosts joined by a slow
link, and writes a PNG.

Example:
    $ hexagram demo --ranks 4 --epochs 2 --algorithms allreduce
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
from typing import Any

import torch
from torch import nn

from hexagram.cli_options import add, positive_int

__all__ = ["add_arguments", "run", "train_worker"]


def _registered() -> list[str]:
    from hexagram.algorithms import registry

    return [n for n in registry.names() if n != "auto"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``hexagram demo``."""
    parser.add_argument("--ranks", type=positive_int, default=4, help="local processes")
    add(parser, "epochs", default=2)
    add(parser, "batch", default=64)
    add(parser, "dataset", default="auto", choices=["auto", "fashion-mnist", "digits"],
        note="auto: Fashion-MNIST when installed, else digits")
    add(parser, "algorithms", default="allreduce", known=_registered, allow_all=False,
        note="see the README's table")
    parser.add_argument("--no-lab", action="store_true",
                        help="skip the slow-link comparison on emulated hosts")
    parser.add_argument("--out", default="hexagram-demo.png", metavar="FILE",
                        help="PNG of the lab comparison")


def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 2048]).argmax(1) == y[i:i + 2048]).sum())
                      for i in range(0, len(y), 2048))
    model.train()
    return correct / len(y)


def _init(hx: Any) -> Any:
    """``hx.init()``: NCCL with a GPU per rank; with fewer GPUs than local ranks, CUDA
    tensors over gloo (several ranks share a GPU); gloo on the CPU without CUDA."""
    gpus = torch.cuda.device_count()
    if 0 < gpus < int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        return hx.init(backend="gloo", device="cuda")
    return hx.init()


def train_worker(algorithm: str, dataset: str, epochs: int, batch: int) -> dict[str, Any]:
    """One rank of the demo: train, evaluate, report (run under hexagram.launch.run_local)."""
    import hexagram as hx
    from hexagram.data import load, shard
    from hexagram.models import mlp

    rt = _init(hx)
    data = load(dataset)
    x, y = shard(data.x_train, data.y_train, rt.rank, rt.world_size)
    x, y = x.to(rt.device), y.to(rt.device)  # the device hx.init() chose
    torch.manual_seed(0)
    model = mlp(data.x_train[0].numel(), 256, 2, data.classes).to(rt.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ddp = hx.DistributedDataParallel(model, optimizers=[opt], algorithm=algorithm)
    gen = torch.Generator().manual_seed(1)  # same permutation on every rank
    history, samples, start = [], 0, time.perf_counter()
    steps_per_epoch = len(data.y_train) // rt.world_size // batch  # equal on every rank
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for step in range(steps_per_epoch):
            idx = order[step * batch:(step + 1) * batch]
            nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
            samples += len(idx) * rt.world_size
        ddp.synchronize()
        history.append({"epoch": epoch + 1, "seconds": time.perf_counter() - start,
                        "accuracy": _evaluate(model, data.x_test.to(rt.device),
                                              data.y_test.to(rt.device))})
    return {"dataset": data.name, "history": history, "samples": samples,
            "bytes": ddp.bytes_sent(), "steps": steps_per_epoch * epochs,
            "params": sum(p.numel() for p in model.parameters())}


def _local_part(args: argparse.Namespace) -> None:
    from hexagram.launch import run_local

    for algorithm in [a.strip() for a in args.algorithms.split(",") if a.strip()]:
        print(f"\n== {algorithm}: {args.ranks} local ranks over loopback ==", flush=True)
        results = run_local(train_worker, args.ranks, timeout=1800,
                            args=(algorithm, args.dataset, args.epochs, args.batch))
        r0 = results[0]
        if algorithm == args.algorithms.split(",")[0]:
            print(f"data: {r0['dataset']}, model: MLP with {r0['params']:,} parameters, "
                  f"batch {args.batch} per rank")
        for h in r0["history"]:
            print(f"epoch {h['epoch']}: test accuracy {100 * h['accuracy']:.2f}%  "
                  f"({h['seconds']:.1f} s)")
        seconds = r0["history"][-1]["seconds"]
        print(f"throughput {r0['samples'] / seconds:,.0f} samples/s; rank 0 sent "
              f"{r0['bytes'] / r0['steps'] / 1e6:.2f} MB/step")


def _lab_part(args: argparse.Namespace) -> None:
    try:
        showcase = importlib.import_module("hexagram.bench.showcase")
    except ModuleNotFoundError:
        print("\n(network lab not available in this build; skipped)")
        return
    print("\n== slow link: PyTorch DDP vs Hexagram on emulated hosts ==", flush=True)
    try:
        showcase.slow_link_comparison(plot=args.out)
    except (PermissionError, FileNotFoundError, RuntimeError) as exc:
        print(f"(network lab unavailable: {exc}; skipped. Run as root with iproute2 "
              "installed to see it.)")


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code."""
    _local_part(args)
    if not args.no_lab:
        _lab_part(args)
    return 0
