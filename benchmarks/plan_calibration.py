"""The calibrated cost model against execution: measured / predicted step time per plan.

For each world size (2 and 4 local gloo CPU ranks, one thread each): calibrate this machine
as a one-host Cluster *on those ranks running together* (compute, gloo links, and the
measured framework overheads of DTensor, FSDP2 and torch.distributed.pipelining, see
``hexagram/parallel/overheads.py``), collect executable plans of a small GPT (the planner's
own choice, the planner under tp / pp / pp x tp / pp x dp constraints, and the hand-made
data-parallel, ZeRO-3 and pipeline-only baselines of ``baselines.py``), run each for
``--warmup`` + ``--steps`` steps on the local ranks and print the median measured step time
(max over ranks, after warm-up) next to the prediction. Also: is the plan with the least
predicted time measured fastest, or within 10% of the fastest?

Run:
    .venv/bin/python benchmarks/plan_calibration.py \\
        --json benchmarks/results/plan_calibration.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from hexagram.errors import HexagramError
from hexagram.launch import run_local
from hexagram.parallel.apply import check_executable
from hexagram.parallel.baselines import evaluate_fixed
from hexagram.parallel.cluster import Cluster, Constraints
from hexagram.parallel.graph import capture
from hexagram.parallel.planner import plan_graph
from hexagram.parallel.plans import Plan
from hexagram.parallel.verify import ParitySpec, build

SPEC = ParitySpec(model="gpt", layers=4, hidden=128, heads=4, vocab=512, seq=32, batch=16,
                  reference=False)


def candidates(cluster: Cluster, world: int) -> dict[str, Plan | None]:
    """The planner's plans (free and constrained) and the hand-made baselines."""
    model, x, _ = build(SPEC)
    graph = capture(model, x)
    cons = {"planner (free)": Constraints(), f"planner tp={world}": Constraints(tp=world),
            f"planner pp={world}": Constraints(pp=world, microbatches=4)}
    if world == 4:
        cons["planner pp2 x tp2"] = Constraints(pp=2, tp=2, microbatches=4)
        cons["planner pp2 x dp2"] = Constraints(pp=2, dp=2, microbatches=4)
    out: dict[str, Plan | None] = {name: plan_graph(graph, cluster, c)
                                   for name, c in cons.items()}
    out["baseline data parallel"] = evaluate_fixed(graph, cluster, 1, world, 1)
    out["baseline ZeRO-3"] = evaluate_fixed(graph, cluster, 1, world, 1, zero=True)
    out["baseline pipeline only"] = evaluate_fixed(graph, cluster, world, 1, 1)
    return out


def _key(p: Plan) -> str:
    return json.dumps([[s.layers, s.dp, s.tp, sorted(s.shardings.items())] for s in p.stages]
                      + [p.microbatches, p.schedule])


def executable(cluster: Cluster, world: int) -> tuple[dict[str, Plan], list[str]]:
    """Distinct candidates the current executor accepts, and why the others were skipped."""
    model, x, _ = build(SPEC)
    out, skipped, seen = {}, [], set()
    for name, p in candidates(cluster, world).items():
        if p is None or _key(p) in seen:
            continue
        seen.add(_key(p))
        try:
            check_executable(model, p, world, x)
        except HexagramError as exc:
            skipped.append(f"{name}: {exc}")
            continue
        out[name] = p
    return out, skipped


def _timed(run: tuple[Any, torch.optim.Optimizer], x: torch.Tensor, y: torch.Tensor,
           steps: int) -> list[float]:
    """Seconds of ``steps`` training steps (forward + backward + sync, as the cost model
    prices; the SGD update is outside the timing), between barriers."""
    pm, opt = run
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        pm.train_step(x, y)
        dist.barrier()
        times.append(time.perf_counter() - start)
        opt.step()
        opt.zero_grad()
    return times


def bench_worker(warmup: int, rounds: int, steps: int) -> dict[str, Any]:
    """Every rank, one job: calibrate, plan, apply every plan, then time them round-robin
    (``rounds`` x ``steps`` steps each, after ``warmup``) so load changes hit all alike."""
    import hexagram as hx
    from hexagram.parallel.apply import parallelize
    from hexagram.parallel.calibrate import calibrated, measure_job

    hx.init()
    world = dist.get_world_size()
    figures = measure_job(SPEC.dtype)
    cluster = calibrated(figures, world, SPEC.dtype)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box[0] = executable(cluster, world)
    dist.broadcast_object_list(box, src=0)
    plans, skipped = box[0]
    models = {}
    _model, x, y = build(SPEC)  # the same batch every step (seeded)
    failed = []
    for name, p in plans.items():
        pm = parallelize(build(SPEC)[0], p, example_inputs=x)
        models[name] = (pm, torch.optim.SGD(pm.parameters(), lr=0.01))
        try:
            _timed(models[name], x, y, warmup)
        except RuntimeError as exc:  # an executor bug: report it, time the others
            failed.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]} "
                          f"(plan {p.to_json(indent=None)})")
            del models[name]
            dist.barrier()
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, run in models.items():
            times[name] += _timed(run, x, y, steps)
    after = measure_job(SPEC.dtype)
    return {"figures": figures, "figures_after": after, "times": times,
            "plans": {n: plans[n].to_json(indent=None) for n in models}, "skipped": skipped,
            "failed": failed}


def run_world(world: int, warmup: int, rounds: int, steps: int) -> dict[str, Any]:
    """One job on ``world`` local ranks; rows of measured vs predicted per plan."""
    load = os.getloadavg()
    res = run_local(bench_worker, world, args=(warmup, rounds, steps), timeout=1200)
    r0 = res[0]
    print(f"# {world} ranks, load {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"calibrated {_brief(r0['figures'])}; after the runs {_brief(r0['figures_after'])}")
    for line in r0["skipped"]:
        print(f"  skipped (the executor refuses it): {line}")
    for line in r0["failed"]:
        print(f"  FAILED in the executor: {line}")
    rows = []
    for name, text in r0["plans"].items():
        p = Plan.from_json(text)
        n = len(r0["times"][name])
        measured = statistics.median(max(r["times"][name][k] for r in res) for k in range(n))
        rows.append({"ranks": world, "name": name, "shape": p.summary().split(":")[0],
                     "predicted_ms": p.step_time_s * 1e3, "measured_ms": measured * 1e3,
                     "ratio": measured / p.step_time_s})
        print("| {ranks} | {name} | {shape} | {predicted_ms:.1f} | {measured_ms:.1f} | "
              "{ratio:.2f} |".format(**rows[-1]), flush=True)
    first = min(rows, key=lambda r: r["predicted_ms"])
    fastest = min(rows, key=lambda r: r["measured_ms"])
    verdict = first["measured_ms"] <= 1.1 * fastest["measured_ms"]
    print(f"# {world} ranks: ranked first {first['name']} ({first['measured_ms']:.1f} ms "
          f"measured), fastest {fastest['name']} ({fastest['measured_ms']:.1f} ms): "
          f"{'within 10%' if verdict else 'NOT within 10%'}", flush=True)
    return {"ranks": world, "load_before": load[0], "load_after": os.getloadavg()[0],
            "figures": r0["figures"], "figures_after": r0["figures_after"], "plans": rows,
            "skipped": r0["skipped"], "failed": r0["failed"], "ranked_first": first["name"],
            "fastest": fastest["name"], "first_within_10pct": verdict}


def _brief(f: dict[str, float]) -> str:
    return (f"{f['device_tflops'] * 1e3:.1f} GFLOP/s, {f['op_overhead_us']:.0f} us/op, link "
            f"{f['latency_us']:.0f} us + {f['gbps']:.2f} Gbit/s, DTensor "
            f"{f['tp_overhead_us']:.0f} us/linear, FSDP2 {f['zero_overhead_us']:.0f} us/unit, "
            f"pipelining {f['microbatch_overhead_us']:.0f} us/micro-batch, step "
            f"{f['step_overhead_us']:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per plan and round")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, "
          f"torch {torch.__version__}; GPT {SPEC.layers} blocks, hidden {SPEC.hidden}, seq "
          f"{SPEC.seq}, vocab {SPEC.vocab}, batch {SPEC.batch}, float64; "
          f"{args.warmup} warm-up steps, then {args.rounds} rounds x {args.steps} timed steps "
          f"of every plan in turn")
    print("| ranks | plan | shape | predicted ms | measured ms | measured/predicted |")
    print("|---|---|---|---|---|---|")
    results = [run_world(w, args.warmup, args.rounds, args.steps) for w in args.worlds]
    ratios = [r["ratio"] for res in results for r in res["plans"]]
    print(f"# measured/predicted {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} plans; "
          f"{sum(0.67 <= v <= 1.5 for v in ratios)} within 0.67-1.5x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "benchmarks/plan_calibration.py", "worlds": results}, f,
                      indent=1, default=str)


if __name__ == "__main__":
    main()
