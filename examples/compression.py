"""Compressed gradients: PowerSGD, QSGD and top-k with error feedback, the wrappers
``hierarchical=``, ``cast=`` and ``delay=1``, and the bytes each one sends.

    torchrun --nproc-per-node 2 examples/compression.py
    torchrun --nproc-per-node 2 examples/compression.py --algorithms qsgd,topk:density=0.05

Each algorithm trains the same model from the same start; rank 0 prints the final loss and
the bytes this rank sent per step (what crossed the wire, not an estimate). About 10 s on a
CPU; unchanged on GPUs (the model and batches go to the device ``hx.init()`` chose).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import hexagram as hx

#: the labels run by default: NAME[:FIELD=VALUE...]; wrappers (hierarchical=true, cast=bf16,
#: delay=1) are keyword arguments of ``get`` like the config fields
DEFAULT = "allreduce,powersgd,powersgd:cast=bf16,qsgd:error_feedback=true,topk,powersgd:delay=1"


def parse(label: str) -> tuple[str, dict[str, Any]]:
    """``"topk:density=0.05"`` -> ``("topk", {"density": 0.05})``."""
    name, *fields = label.split(":")
    config: dict[str, Any] = {}
    for field in fields:
        key, value = field.split("=")
        config[key] = {"true": True, "false": False}.get(value, value)
        for kind in (int, float):
            try:
                config[key] = kind(value)
                break
            except ValueError:
                pass
    return name, config


def batch(rt: hx.Runtime, n: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic classification batch of this rank: labels from a fixed random teacher."""
    g = torch.Generator().manual_seed(1000 * step + rt.rank)
    x = torch.randn(n, 64, generator=g)
    teacher = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    return x.to(rt.device), (x @ teacher).argmax(1).to(rt.device)


def train(rt: hx.Runtime, label: str, steps: int, n: int) -> dict[str, float]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(rt.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    name, config = parse(label)
    if name == "powersgd":
        config.setdefault("start_iter", 0)        # compress from the first step
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(name, **config))
    for step in range(steps):
        x, y = batch(rt, n, step)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()                           # delay=1: applies the pending gradient
    result = {"loss": loss.item(), "bytes_per_step": model.bytes_sent() / steps}
    model.close()
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default=DEFAULT, help="comma-separated labels")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    args = parser.parse_args(argv)

    rt = hx.init()
    results = {label: train(rt, label, args.steps, args.batch)
               for label in args.algorithms.split(",")}
    if rt.rank == 0:
        for label, r in results.items():
            print(f"{label:40s} loss {r['loss']:.3f}  {r['bytes_per_step'] / 1e3:8.1f} kB/step")
    hx.shutdown()
    return results


if __name__ == "__main__":
    main()
