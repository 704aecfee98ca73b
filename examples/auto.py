"""Let Hexagram choose the algorithm: ``algorithm="auto"`` on a small classifier.

    torchrun --nproc-per-node 2 examples/auto.py
    python examples/auto.py                      # one process: nothing to communicate

`auto` probes the network, profiles the model, predicts every candidate's step time, times
the near-ties and runs the best; rank 0 prints the table. About 10 s on a CPU with these
defaults; unchanged on GPUs (the model and batches go to the device ``hx.init()`` chose).
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


def main(argv: Sequence[str] | None = None) -> dict[str, float | str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--algorithms", default="allreduce,fp16,powersgd",
                        help="the candidates auto chooses among")
    args = parser.parse_args(argv)

    rt = hx.init()
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(rt.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    auto = hx.algorithms.get("auto", candidates=args.algorithms.split(","), probe_budget_s=1.0)
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=auto)
    for step in range(args.steps):
        x, y = batch(rt, args.batch, step)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    chosen = str(model.algorithm.label)           # the algorithm auto delegates to
    if rt.rank == 0:
        print(f"auto ran {chosen}; final loss {loss.item():.3f}")
    result = {"loss": loss.item(), "chosen": chosen}
    model.close()
    hx.shutdown()
    return result


if __name__ == "__main__":
    main()
