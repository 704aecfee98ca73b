"""Checkpoints and restarts: a rank dies mid-run, torchrun restarts the job, and it resumes
from the last committed checkpoint exactly where it stopped (algorithm state included).

    torchrun --nproc-per-node 2 --max-restarts 1 examples/elastic_restart.py --crash-at 12
    python examples/elastic_restart.py --crash-at 12; python examples/elastic_restart.py

``--crash-at`` makes rank 0 die at that step in the first attempt only (torchrun counts
attempts in TORCHELASTIC_RESTART_COUNT; run plainly, the second command is the restart).
Checkpoints go to ``--dir`` every ``--every`` steps (every rank's model, optimizer and
PowerSGD state, written with torch.distributed.checkpoint). About 10 s on a CPU; unchanged
on GPUs (the model and batches go to the device ``hx.init()`` chose). Live mode, where the
survivors keep training without a restart, is described in docs/elastic.md.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import torch
from torch import nn

import hexagram as hx


class SimulatedFailure(SystemExit):
    """The process dies (exit code 1) as a crashed rank would."""


def batch(rt: hx.Runtime, n: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of this rank at ``step``: the same after a restart, so a resumed run
    sees the data it would have seen."""
    g = torch.Generator().manual_seed(1000 * step + rt.rank)
    x = torch.randn(n, 64, generator=g)
    teacher = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    return x.to(rt.device), (x @ teacher).argmax(1).to(rt.device)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="hexagram-ckpt", help="shared checkpoint directory")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    args = parser.parse_args(argv)

    rt = hx.init(timeout=60, init_timeout=60)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(rt.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    algo = hx.algorithms.get("powersgd", start_iter=0)
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)
    start = hx.load_checkpoint(args.dir, model, [opt]) or 0     # None: nothing saved yet
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and start == 0
    if rt.rank == 0:
        print(f"starting at step {start}")
    for step in range(start, args.steps):
        if first_attempt and step == args.crash_at and rt.rank == 0:
            raise SimulatedFailure(f"rank 0: simulated failure at step {step}")
        x, y = batch(rt, args.batch, step)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.every == 0:
            hx.save_checkpoint(args.dir, model, [opt], step=step + 1, keep=2)
    model.synchronize()
    if rt.rank == 0:
        print(f"finished step {args.steps}: loss {loss.item():.3f}")
    result = {"start": float(start), "loss": loss.item()}
    model.close()
    hx.shutdown()
    return result


if __name__ == "__main__":
    main()
