"""Hexagram allreduce (or ``--algorithm``) vs PyTorch DDP, alternating in one run on local
ranks (loopback).

Both wrappers train identical copies of one MLP on the same batches; blocks of steps
alternate between them so machine load affects both alike. Prints per-step medians and the
ratio Hexagram / DDP (target <= 1.03). ``--algorithm auto --warmup 15`` measures auto after
its probe, profile and trials.

    .venv/bin/python benchmarks/engine_vs_ddp.py --ranks 4 --params 6.3e6 --rounds 8
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
from torch import nn


def _worker(params: float, batch: int, rounds: int, block: int, bucket_mb: float,
            ddp_views: bool, algorithm: str = "allreduce", warmup: int = 0
            ) -> dict[str, object]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import hexagram as hx
    from hexagram.bench.loop import Loop, train_step
    from hexagram.models import hidden_for_params, mlp

    rt = hx.init()
    hidden = hidden_for_params(int(params), 784, 3, 10)
    torch.manual_seed(0)
    a, b = mlp(784, hidden, 3, 10), mlp(784, hidden, 3, 10)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.SGD(a.parameters(), lr=0.01)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.01)
    from hexagram.auto.choose import parse_label

    name, config = parse_label(algorithm)  # e.g. "allreduce:delay=1:predict=false"
    algo = hx.algorithms.get(name, **config, **({"verbose": False} if name == "auto" else {}))
    ours = hx.DistributedDataParallel(a, optimizers=[opt_a],
                                      algorithm=algo, bucket_size_mb=bucket_mb)
    theirs = TorchDDP(b, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=ddp_views)
    gen = torch.Generator().manual_seed(rt.rank)
    x, y = torch.randn(batch, 784, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    loss = nn.functional.cross_entropy
    loops = {"hexagram": Loop(step=train_step(ours, opt_a, loss)),
             "ddp": Loop(step=train_step(theirs, opt_b, loss))}

    def run(key: str, steps: int = block) -> None:
        for _ in range(steps):
            loops[key].run(x, y)

    run("hexagram", max(block, warmup))  # warm-up; re-buckets by ready order
    run("ddp")
    warm = {key: loop.steps for key, loop in loops.items()}
    for r in range(rounds):
        pair = ["hexagram", "ddp"]
        for key in (pair if r % 2 == 0 else pair[::-1]):
            dist.barrier()
            run(key)
    times = {key: loop.times[warm[key]:] for key, loop in loops.items()}
    n_params = sum(p.numel() for p in a.parameters())
    return {"times": times, "params": n_params, "bytes": ours.bytes_sent(),
            "ran": getattr(algo, "label", algorithm)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--params", type=float, default=6.3e6, help="MLP size (parameters)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8, help="alternations of the two")
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--ddp-gradient-as-bucket-view", action="store_true",
                        help="give PyTorch DDP Hexagram's default (gradients as bucket views; "
                        "DDP's own default is off)")
    parser.add_argument("--algorithm", default="allreduce", help="Hexagram's side, e.g. auto")
    parser.add_argument("--warmup", type=int, default=0,
                        help="untimed Hexagram steps first (at least --block; auto: 15)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    from hexagram.launch import run_local

    results = run_local(_worker, args.ranks, args=(args.params, args.batch, args.rounds,
                                                   args.block, args.bucket_mb,
                                                   args.ddp_gradient_as_bucket_view,
                                                   args.algorithm, args.warmup),
                         timeout=1800)
    # A step is as slow as its slowest rank: take the max over ranks, step by step.
    per_step = {k: [max(r["times"][k][i] for r in results)  # type: ignore[index]
                    for i in range(len(results[0]["times"][k]))]  # type: ignore[index]
                for k in ("hexagram", "ddp")}
    med = {k: statistics.median(v) for k, v in per_step.items()}
    ratio = med["hexagram"] / med["ddp"]
    print(f"machine: {platform.node()} {platform.machine()}, {torch.get_num_threads()} threads,"
          f" torch {torch.__version__}; {args.ranks} ranks on loopback (gloo), "
          f"{results[0]['params']:,} parameters, batch {args.batch}")
    for k, v in per_step.items():
        q = statistics.quantiles(v, n=4)
        print(f"{k:9s} median {med[k] * 1e3:8.2f} ms/step  (IQR {q[0] * 1e3:.2f}-"
              f"{q[2] * 1e3:.2f}, {len(v)} steps)")
    print(f"hexagram ran {results[0]['ran']}")
    print(f"ratio hexagram/ddp = {ratio:.3f}  (target <= 1.03)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "median_s": med, "ratio": ratio,
                       "per_step_s": per_step, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
