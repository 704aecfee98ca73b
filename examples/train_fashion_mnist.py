"""Train an MLP on Fashion-MNIST with any Hexagram algorithm, launched by torchrun.

    torchrun --nproc-per-node 4 examples/train_fashion_mnist.py --algorithm allreduce
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --rdzv-backend c10d \
        --rdzv-endpoint host0:29500 examples/train_fashion_mnist.py --algorithm bytegrad

Run plainly (`python examples/train_fashion_mnist.py`) it trains with world size 1.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import hexagram as hx
from hexagram.data import load, shard
from hexagram.models import mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="allreduce", choices=hx.algorithms.names())
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--dataset", default="auto")
    args = parser.parse_args()

    rt = hx.init()
    data = load(args.dataset)
    x, y = shard(data.x_train, data.y_train, rt.rank, rt.world_size)
    x, y = x.to(rt.device), y.to(rt.device)  # the device hx.init() chose (a GPU with NCCL)
    model = mlp(data.x_train[0].numel(), 256, 2, data.classes).to(rt.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model_dp = hx.DistributedDataParallel(model, [opt], algorithm=args.algorithm)
    steps = len(data.y_train) // rt.world_size // args.batch  # equal on every rank
    gen = torch.Generator().manual_seed(0)
    for epoch in range(args.epochs):
        order = torch.randperm(len(y), generator=gen)
        for step in range(steps):
            idx = order[step * args.batch:(step + 1) * args.batch]
            nn.functional.cross_entropy(model_dp(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
        model_dp.synchronize()
        with torch.no_grad():
            test_x, test_y = data.x_test.to(rt.device), data.y_test.to(rt.device)
            acc = (model(test_x).argmax(1) == test_y).float().mean().item()
        if rt.rank == 0:
            print(f"epoch {epoch + 1}: test accuracy {100 * acc:.2f}%, "
                  f"sent {model_dp.bytes_sent() / 1e6:.1f} MB so far")
    model_dp.close()
    hx.shutdown()


if __name__ == "__main__":
    main()
