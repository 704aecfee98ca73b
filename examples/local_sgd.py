"""Local SGD and DiLoCo: replicas train alone for ``period`` steps, then average.

    torchrun --nproc-per-node 2 examples/local_sgd.py
    torchrun --nproc-per-node 2 examples/local_sgd.py --algorithm diloco --period 10

Weight algorithms communicate after the optimizer step, so the wrapper needs the
optimizers (``optimizers=[opt]``); ``synchronize()`` leaves every rank with the consensus
weights. About 10 s on a CPU; unchanged on GPUs (the model and batches go to the device
``hx.init()`` chose).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import torch.distributed as dist
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
    parser.add_argument("--algorithm", choices=("local_sgd", "diloco"), default="local_sgd")
    parser.add_argument("--period", type=int, default=5, help="local steps between averages")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    args = parser.parse_args(argv)

    rt = hx.init()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(rt.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)   # DiLoCo's inner optimizer
    algo = hx.algorithms.get(args.algorithm, period=args.period)
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)
    for step in range(args.steps):
        x, y = batch(rt, args.batch, step)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()                          # every replica now holds the same weights
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    lo, hi = flat.clone(), flat.clone()          # check: how far apart are the replicas?
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    result = {"loss": loss.item(), "replica_spread": float((hi - lo).max()),
              "bytes_per_step": model.bytes_sent() / args.steps}
    if rt.rank == 0:
        print(f"{args.algorithm} (period {args.period}): loss {result['loss']:.3f}, "
              f"{result['bytes_per_step'] / 1e3:.1f} kB/step, replicas differ by at most "
              f"{result['replica_spread']:.2e} after synchronize()")
    model.close()
    hx.shutdown()
    return result


if __name__ == "__main__":
    main()
