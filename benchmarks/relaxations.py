"""Decentralized, delayed and asynchronous algorithms vs PyTorch DDP and PeriodicModelAverager.

One run on local ranks (loopback, gloo): for each configuration, wrap a fresh copy of one
MLP, warm up, then time ``--steps`` training steps (barrier before and after, rank 0's
clock) and read the bytes this rank sent. Prints, per configuration, wire bytes per step
(per rank), the ratio to DDP, and steps per second, plus the machine.

Byte counts: Hexagram counts what each collective sends (ring allreduce ``2 (P-1)/P x n``,
allgather ``(P-1) x n``, point-to-point ``n`` per peer). PyTorch does not count, so its rows
use the same formulas for what it communicates (DDP: one ring allreduce of the gradients per
step; PeriodicModelAverager: one ring allreduce of the parameters per period), marked
``est``.

    .venv/bin/python benchmarks/relaxations.py --ranks 4 --steps 80 --params 1e6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

PERIOD = 8


def _configs(compressor: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, algorithm or torch peer, config) in the order they are measured."""
    return [
        ("local only (no communication)", "none", {}),
        ("torch DDP (allreduce)", "torch-ddp", {}),
        (f"torch PeriodicModelAverager (H={PERIOD})", "torch-averager", {}),
        ("hexagram allreduce", "allreduce", {}),
        ("decentralized peers=all", "decentralized", {"peers": "all"}),
        ("decentralized peers=ring", "decentralized", {"peers": "ring"}),
        ("decentralized peers=shift_one", "decentralized", {"peers": "shift_one"}),
        ("decentralized ring interval=4", "decentralized", {"peers": "ring", "interval": 4}),
        (f"low_precision_decentralized ({compressor})", "low_precision_decentralized",
         {"compressor": compressor}),
        (f"local_sgd H={PERIOD}", "local_sgd", {"period": PERIOD}),
        (f"local_sgd H={PERIOD} + {compressor}", "local_sgd",
         {"period": PERIOD, "compressor": compressor}),
        (f"diloco H={PERIOD}", "diloco", {"period": PERIOD}),
        (f"diloco H={PERIOD} + {compressor}", "diloco",
         {"period": PERIOD, "compressor": compressor}),
        (f"streaming diloco H={PERIOD}, 4 fragments", "diloco",
         {"period": PERIOD, "fragments": 4}),
        (f"streaming diloco H={PERIOD}, 4 fragments + qsgd 4-bit", "diloco",
         {"period": PERIOD, "fragments": 4, "compressor": "qsgd"}),
        (f"streaming diloco H={PERIOD}, 4 fragments, overlap 1 step", "diloco",
         {"period": PERIOD, "fragments": 4, "overlap_steps": 1}),
        (f"qadam ({compressor}) after 5 warm-up steps", "qadam", {"compressor": compressor}),
        ("async interval=50ms", "async", {"interval_ms": 50.0}),
    ]


def _ring(nbytes: int, world: int) -> int:
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


def _wrap(kind: str, cfg: dict[str, Any], net: nn.Module, opt: torch.optim.Optimizer
          ) -> tuple[nn.Module, Callable[[], None], Callable[[], int], Callable[[], None]]:
    """(model to call, after-step hook, bytes sent so far, close)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging import averagers
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import hexagram as hx

    world = dist.get_world_size()
    nbytes = 4 * sum(p.numel() for p in net.parameters())
    steps = [0]

    def count() -> None:
        steps[0] += 1

    if kind == "none":
        return net, count, lambda: 0, lambda: None
    if kind == "torch-ddp":
        return TorchDDP(net), count, lambda: steps[0] * _ring(nbytes, world), lambda: None
    if kind == "torch-averager":
        averager = averagers.PeriodicModelAverager(period=PERIOD, warmup_steps=0)

        def average() -> None:
            averager.average_parameters(net.parameters())
            count()

        return net, average, lambda: (steps[0] // PERIOD) * _ring(nbytes, world), lambda: None
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(kind, **cfg))
    return model, lambda: None, model.bytes_sent, model.close


def _measure(kind: str, cfg: dict[str, Any], params: float, batch: int, steps: int
             ) -> dict[str, float]:
    import torch.distributed as dist

    from hexagram.bench.loop import train_step
    from hexagram.models import hidden_for_params, mlp
    from hexagram.optim import QAdamOptimizer

    hidden = hidden_for_params(int(params), 784, 2, 10)
    torch.manual_seed(0)
    net = mlp(784, hidden, 2, 10)
    opt: torch.optim.Optimizer = (QAdamOptimizer(net.parameters(), lr=1e-3, warmup_steps=5)
                                  if kind == "qadam" else
                                  torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    model, after, sent, close = _wrap(kind, cfg, net, opt)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, 784, generator=gen), torch.randint(0, 10, (batch,), generator=gen)

    # after() runs before zero_grad: the averager skips parameters whose .grad is None
    step = train_step(model, opt, nn.functional.cross_entropy, after)
    for _ in range(8):  # warm-up (QAdam: past its 5 full-precision steps)
        step(x, y)
    dist.barrier()
    start_bytes, start = sent(), time.perf_counter()
    for _ in range(steps):
        step(x, y)
    dist.barrier()
    elapsed = time.perf_counter() - start
    per_step = (sent() - start_bytes) / steps
    synchronize = getattr(model, "synchronize", None)
    if callable(synchronize):
        synchronize()
    close()
    return {"bytes_per_step": per_step, "steps_per_s": steps / elapsed,
            "params": float(sum(p.numel() for p in net.parameters()))}


def _worker(params: float, batch: int, steps: int, compressor: str) -> list[dict[str, Any]]:
    import hexagram as hx

    hx.init()
    rows = []
    for label, kind, cfg in _configs(compressor):
        rows.append({"label": label, **_measure(kind, cfg, params, batch, steps)})
    return rows


def _default_compressor() -> str:
    import hexagram.compress as hc

    return "minmax8" if "minmax8" in hc.names() else "fp16"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--params", type=float, default=1e6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--compressor", default=None, help="default: minmax8 if registered")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    from hexagram.launch import run_local

    compressor = args.compressor or _default_compressor()
    rows = run_local(_worker, args.ranks, args=(args.params, args.batch, args.steps, compressor),
                     timeout=1800)[0]
    ddp = next(r for r in rows if r["label"].startswith("torch DDP"))["bytes_per_step"]
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, "
          f"{platform.python_version()}, torch {torch.__version__}; {args.ranks} ranks on "
          f"loopback (gloo), MLP {int(rows[0]['params']):,} params, batch {args.batch}, "
          f"{args.steps} timed steps")
    print(f"{'configuration':48s} {'wire KB/step':>12s} {'vs DDP':>7s} {'steps/s':>8s}")
    for r in rows:
        est = " est" if r["label"].startswith("torch") else ""
        print(f"{r['label']:48s} {r['bytes_per_step'] / 1024:12.1f} "
              f"{r['bytes_per_step'] / ddp:7.3f} {r['steps_per_s']:8.1f}{est}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
