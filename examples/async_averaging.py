"""Asynchronous model averaging: a background thread averages the weights every
``interval_ms`` while the training loop never waits for the network.

    torchrun --nproc-per-node 2 examples/async_averaging.py
    torchrun --nproc-per-node 2 examples/async_averaging.py --interval-ms 10

Like every weight algorithm it needs the optimizers (``optimizers=[opt]``) and ends with
``synchronize()`` (the consensus weights). About 10 s on a CPU; unchanged on GPUs (the
model and batches go to the device ``hx.init()`` chose).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from torch import nn

import hexagram as hx


def batch(rt: hx.Runtime, n: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic classification batch of this rank: labels from a fixed random teacher."""
    g = torch.Generator().manual_seed(1000 * step + rt.rank)
    x = torch.randn(n, 64, generator=g)
    teacher = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    return x.to(rt.device), (x @ teacher).argmax(1).to(rt.device)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    args = parser.parse_args(argv)

    rt = hx.init()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(rt.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    algo = hx.algorithms.get("async", interval_ms=args.interval_ms)
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)
    for step in range(args.steps):
        x, y = batch(rt, args.batch, step)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()                               # never blocks on the averaging thread
        opt.zero_grad()
    model.synchronize()
    result = {"loss": loss.item(), "bytes_sent": float(model.bytes_sent())}
    if rt.rank == 0:
        print(f"async every {args.interval_ms:.0f} ms: loss {result['loss']:.3f}, "
              f"{result['bytes_sent'] / 1e3:.1f} kB sent by the background thread")
    model.close()
    hx.shutdown()
    return result


if __name__ == "__main__":
    main()
