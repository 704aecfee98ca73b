"""When does each bucket become ready, and how long does a step wait after backward?

Runs one Hexagram algorithm on the lab (4 hosts by default) with the bench's MLP and prints,
for each timed step of ranks 0 and P-1: the start of backward, each bucket's hook (ready ->
compressed and handed to the communicator: the time inside is the algorithm's work on the
training thread), the end of the last hook, when ``backward()`` returned (every handle
waited, results in ``.grad``) and the end of the step. The gap between the last hook and
``backward()`` returning is the step's *tail*: communication (and decoding) that nothing
could overlap.

    sudo .venv/bin/python benchmarks/lab_timeline.py --algorithm topk --batch 256 \\
        --bandwidth 100mbit [--bucket-mb 4] [--set density=0.01]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any


def _trace(args: argparse.Namespace) -> list[list[tuple[str, float, float]]]:
    """Run the steps; per timed step, events (name, start, end) relative to its start."""
    import torch

    import hexagram as hx
    from hexagram.bench.peers import make_optimizer
    from hexagram.models.workload import ModelSpec, build_workload

    hx.init()
    work = build_workload(ModelSpec(name="mlp", params=args.params), seed=0)
    opt = make_optimizer(args.algorithm, work.model.parameters(), 0.01, warmup=args.warmup)
    config = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    algorithm = hx.algorithms.get(args.algorithm, **config)
    model = hx.DistributedDataParallel(work.model, optimizers=[opt], algorithm=algorithm,
                                       bucket_size_mb=args.bucket_mb,
                                       first_bucket_mb=min(1.0, args.bucket_mb))
    events: list[tuple[str, float, float]] = []
    inner = algorithm.bucket_ready

    def timed(bucket: Any) -> Any:  # this instance only: the engine calls it per bucket
        t0 = time.perf_counter()
        handle = inner(bucket)
        events.append((f"bucket {bucket.index} ({bucket.numel / 1e6:.2f}M)", t0,
                       time.perf_counter()))
        return handle

    algorithm.bucket_ready = timed  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(hx.get_runtime().rank)
    steps: list[list[tuple[str, float, float]]] = []
    for i in range(args.warmup + args.steps):
        events.clear()
        x, y = work.batch(args.batch, gen)
        start = time.perf_counter()
        loss = work.loss(model(x), y)
        events.append(("forward", start, time.perf_counter()))
        t0 = time.perf_counter()
        loss.backward()
        events.append(("backward() returned", t0, time.perf_counter()))
        opt.step()
        opt.zero_grad()
        events.append(("step done", start, time.perf_counter()))
        if i >= args.warmup:
            steps.append([(n, a - start, b - start) for n, a, b in events])
    model.close()
    return steps


def _print(rank: int, steps: list[list[tuple[str, float, float]]]) -> None:
    print(f"rank {rank}: times in ms from the step's start")
    tails = []
    for i, events in enumerate(steps):
        print(f"  step {i}")
        for name, a, b in sorted(events, key=lambda e: (e[2], e[1])):
            print(f"    {name:28s} {1e3 * a:8.1f} -> {1e3 * b:8.1f}")
        last_hook = max(b for n, _, b in events if n.startswith("bucket"))
        returned = next(b for n, _, b in events if n == "backward() returned")
        tails.append(returned - last_hook)
    print(f"  tail (last hook -> backward() returned), median: "
          f"{1e3 * statistics.median(tails):.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="topk")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--bandwidth", default="100mbit")
    parser.add_argument("--params", type=int, default=10_500_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="algorithm config (value parsed as JSON), repeatable")
    parser.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_mode:
        import torch

        torch.set_num_threads(1)
        steps = _trace(args)
        rank = int(os.environ["RANK"])
        if rank in (0, args.hosts - 1):
            _print(rank, steps)
        return 0
    from hexagram.bench.lab import LabConfig, NetworkLab

    argv = sys.argv[1:]
    with NetworkLab(LabConfig(hosts=args.hosts, bandwidth=args.bandwidth)) as lab:
        results = lab.run([sys.executable, __file__, *argv, "--rank-mode"], timeout=600)
    for r in (results[0], results[-1]):
        print("\n".join(ln for ln in r.output.splitlines() if not ln.startswith("[W")))
    return 0 if all(r.returncode == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
