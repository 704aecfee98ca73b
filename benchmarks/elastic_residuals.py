"""What a dead replica takes with it: PowerSGD's error-feedback residuals, measured.

PowerSGD's update depends on the ranks' residuals only through their mean: ``P = mean(M_i)
Q`` and ``Q = mean(M_i)^T P`` are linear in ``M_i = g_i + e_i``. Each rank's residual is
``e_i = e_bar + d_i``, where the *deviation* ``d_i`` (summing to 0 over the ranks) grows as
the running sum of that rank's gradient noise ``g_i - g_bar`` (``e_i' - e_bar' = d_i + g_i -
g_bar``): a random walk that never enters the update, as long as every rank stays. When
replica ``k`` of ``n`` dies, the survivors' mean residual becomes ``e_bar - d_k / (n-1)``:
that shift is then applied to the model as if it were gradient.

This script trains the soak's model (:mod:`hexagram.bench.soak`: 4 ranks, Fashion-MNIST,
the same batches, SGD lr 0.05 momentum 0.9) with PowerSGD and no failures, on
``torch.distributed`` through :func:`hexagram.launch.run_local`, and reports at the soak's
kill steps the norms of ``e_bar``, of every ``d_i / (n-1)`` (the shift a death there would
apply) and of the applied gradient of one step (the mean over the preceding 10 steps).

    python benchmarks/elastic_residuals.py --seeds 0,1,2 --json /tmp/residuals.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hexagram.bench import soak
from hexagram.elastic.state import residual_tensors


def _rank(steps: int, probes: list[int], dataset: str, batch: int, lr: float,
          seed: int, algorithm: str) -> dict[str, Any]:
    import hexagram as hx

    hx.init()
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    data = soak._data(dataset)
    net = soak.model_for(data, seed=seed)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(algorithm))
    grad_norms, residuals = [], {}
    for step in range(steps):
        if step in probes:
            flat = [t.reshape(-1).double() for t in
                    residual_tensors(model.algorithm_state_dict()).values()]
            residuals[step] = torch.cat(flat) if flat else torch.zeros(0)
        x, y = soak.global_batch(data, step, rank, world, world, batch, seed)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grad_norms.append(float(torch.cat([p.grad.reshape(-1) for p in net.parameters()])
                                .norm()))
        opt.step()
    model.close()
    return {"residuals": residuals, "grad_norms": grad_norms,
            "accuracy": soak.accuracy(net, data)}


def measure(seed: int, steps: int = 600, probes: tuple[int, ...] = (100, 200, 300, 400, 500),
            world: int = 4, dataset: str = "auto", batch: int = 32, lr: float = 0.05,
            algorithm: str = "powersgd") -> list[dict[str, Any]]:
    """One failure-free run; per probe step: ``mean_residual`` (||e_bar||), ``shifts``
    (||d_i|| / (n-1) per rank), ``step_gradient`` (mean ||applied gradient|| over the 10
    steps before), all L2 norms over the whole model."""
    from hexagram.launch import run_local

    soak._data(dataset)
    ranks = run_local(_rank, world, (steps, list(probes), dataset, batch, lr, seed,
                                     algorithm), timeout=1800)
    out = []
    for step in probes:
        stacked = torch.stack([r["residuals"][step] for r in ranks])
        mean = stacked.mean(0)
        shifts = [float((e - mean).norm()) / (world - 1) for e in stacked]
        recent = ranks[0]["grad_norms"][step - 10:step]
        out.append({"seed": seed, "step": step, "mean_residual": float(mean.norm()),
                    "shifts": shifts, "step_gradient": statistics.mean(recent),
                    "accuracy": ranks[0]["accuracy"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--algorithm", default="powersgd")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [row for seed in args.seeds.split(",")
            for row in measure(int(seed), algorithm=args.algorithm)]
    print("| seed | step | ||mean residual|| | shift of a death, ||d_i||/(n-1), per rank "
          "| ||applied gradient|| per step | shift / step gradient |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        shifts = ", ".join(f"{s:.3f}" for s in r["shifts"])
        ratio = statistics.mean(r["shifts"]) / r["step_gradient"]
        print(f"| {r['seed']} | {r['step']} | {r['mean_residual']:.3f} | {shifts} "
              f"| {r['step_gradient']:.3f} | {ratio:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
