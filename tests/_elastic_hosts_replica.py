"""A live-mode training script as a user writes it for several machines (run by
tests/test_elastic_hosts.py under ``hexagram elastic-run``): everything about the job comes
from the environment ``elastic-run`` sets. Writes its log and parameters to ``OUT``."""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import torch
from torch import nn

import hexagram as hx
from hexagram.bench.live import batch, net


def _loss_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.mse_loss(model(x), y).backward()


def main(out: str, steps: int, want: int, pause: float) -> None:
    torch.set_num_threads(1)
    module = net()
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    trainer = hx.elastic.live(module, [opt], "allreduce", min_size=1, heartbeat_timeout=2.0,
                              timeout=20.0, join_timeout=30.0)
    log: list[tuple[int, list[int]]] = []
    epoch, full_since = None, None
    # past `steps`, train on until `want` replicas have trained 5 steps together
    while trainer.step < steps or full_since is None or trainer.step < full_since + 5:
        if trainer.epoch.number != epoch:
            epoch = trainer.epoch.number
            full_since = trainer.step if trainer.size == want else None
        members, (x, y) = list(trainer.epoch.members), batch(trainer.step, trainer.replica)
        if trainer.run_step(functools.partial(_loss_backward, x=x, y=y)):
            log.append((trainer.step - 1, members))
        time.sleep(pause)  # paced, so the test can kill a host while steps run
    params = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    torch.save({"log": log, "params": params, "step": trainer.step,
                "memberships": trainer.stats["memberships"]},
               Path(out) / f"replica{trainer.replica}.pt")
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
