"""Automatic model parallelism: plan a small GPT for the running job, apply the plan with
DTensor / pipelining / FSDP2, and train it.

    torchrun --nproc-per-node 2 examples/planner.py
    torchrun --nproc-per-node 2 examples/planner.py --pp 2        # force two pipeline stages

The planner chooses sharding (an ILP, HiGHS) and pipeline stages (dynamic programming) from
a cost model of the cluster; here the cluster is this job (1 host x WORLD_SIZE devices, the
default link and device figures: pass ``hexagram.parallel.auto`` to measure them instead).
Needs the planner extra (``pip install "hexagram[planner]"``). About 10 s on a CPU;
unchanged on GPUs (the model is built on the device ``hx.init()`` chose).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

import hexagram as hx
import hexagram.parallel as hp

VOCAB, SEQ = 64, 16


def main(argv: Sequence[str] | None = None) -> dict[str, float | str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pp", type=int, default=None, help="pipeline stages (default: planned)")
    args = parser.parse_args(argv)

    rt = hx.init()
    shape = {"layers": args.layers, "hidden": args.width, "heads": 4, "vocab": VOCAB,
             "seq": SEQ}
    tokens = torch.zeros(args.global_batch, SEQ, dtype=torch.long, device="meta")
    plan = hp.plan(hp.gpt(**shape, device="meta"), tokens,      # planned without memory
                   cluster=hp.Cluster(hosts=1, devices_per_host=rt.world_size),
                   constraints=hp.Constraints(pp=args.pp))
    if rt.rank == 0:
        print(plan)
    torch.manual_seed(0)                                        # the same weights everywhere
    pm = hp.parallelize(hp.gpt(**shape, device=rt.device), plan)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(args.steps):
        x = torch.randint(0, VOCAB, (args.global_batch, SEQ), generator=g).to(rt.device)
        y = torch.roll(x, -1, dims=1)                           # next token
        loss = pm.train_step(x, y)                              # None off the last stage
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(float(loss))
    if losses:
        print(f"rank {rt.rank}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    hx.shutdown()
    return {"plan": str(plan), "first_loss": losses[0] if losses else float("nan"),
            "last_loss": losses[-1] if losses else float("nan")}


if __name__ == "__main__":
    main()
