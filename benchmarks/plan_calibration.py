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

The compute fields are then scaled by the model's own measured forward + backward step
(``overheads.model_compute_scale``: every rank at once, per-rank share of the batch, against
the roofline's prediction of that step), so operator shapes the microbenchmarks miss and
ranks sharing cores are priced, and the cores the ranks effectively share are measured
(``cores``: ranks x rank 0's step alone / the step with every rank busy), so a pipeline
whose ranks idle in the bubble is priced as sharing the cores less
(``Cluster.cores_per_host``, ``inter.core_factor``). The overheads are measured on layers of
the GPT's own shape, in interleaved turns against their plain twins, and the calibration is
repeated after the runs (both printed). Each row also shows the prediction of the same plan without
that scale (microbenchmarks only, the model of the earlier runs) and the prediction split by
term (``hexagram.parallel.reprice.breakdown``).

Run:
    .venv/bin/python benchmarks/plan_calibration.py \\
        --json benchmarks/results/plan_calibration.json
Calibrate only, K times per world size, 120 s apart (repeatability of the figures):
    .venv/bin/python benchmarks/plan_calibration.py --calibrations 2 --gap 120
Re-predict a stored run without executing anything (its plans priced again, split by term;
older files without plan text are re-planned from their calibration figures):
    .venv/bin/python benchmarks/plan_calibration.py --reprice \\
        benchmarks/results/plan_calibration_quiet.json
"""

from __future__ import annotations

import argparse
import functools
import gc
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
from hexagram.parallel.graph import ModelGraph, capture
from hexagram.parallel.planner import plan_graph
from hexagram.parallel.plans import Plan
from hexagram.parallel.reprice import breakdown, price
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
           steps: int, untimed: int = 0) -> list[float]:
    """Seconds of ``steps`` training steps (forward + backward + sync, as the cost model
    prices; the SGD update is outside the timing), between barriers, after ``untimed``
    steps that are run but not timed."""
    pm, opt = run
    times = []
    for k in range(untimed + steps):
        dist.barrier()
        start = time.perf_counter()
        pm.train_step(x, y)
        dist.barrier()
        if k >= untimed:
            times.append(time.perf_counter() - start)
        opt.step()
        opt.zero_grad()
    return times


def model_cluster(figures: dict[str, float], world: int, scaled: bool = True) -> Cluster:
    """The calibrated one-host cluster, with the model-measured compute scale and cores if
    present (and ``scaled``)."""
    from hexagram.parallel.calibrate import calibrated, with_model_figures

    cluster = calibrated(figures, world, SPEC.dtype)
    return with_model_figures(cluster, figures) if scaled else cluster


@functools.cache
def _graph() -> ModelGraph:
    return capture(*build(SPEC)[:2])


#: the model itself on every rank's share of the batch, timed in the rounds with the plans
REFERENCE = "model step (every rank, batch / world)"


class _Reference:
    """What ``model_compute_scale`` times (forward + backward of the whole model on
    ``batch / world`` samples per rank), with the ``train_step`` of a ParallelModel, so
    the load during the plans' rounds can be read off the same rounds."""

    def __init__(self, world: int) -> None:
        from hexagram.parallel.apply import default_loss

        self.model, self.rows, self.loss = build(SPEC)[0], max(1, SPEC.batch // world), \
            default_loss

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.loss(self.model(x[: self.rows]), y[: self.rows]).backward()

    def parameters(self) -> Any:
        return self.model.parameters()


def _applied(plans: dict[str, Plan], x: torch.Tensor, y: torch.Tensor, warmup: int
             ) -> tuple[dict[str, tuple[Any, torch.optim.Optimizer]], list[str]]:
    """Every plan applied to a fresh model and run ``warmup`` steps (collective); the
    plans the executor fails on are reported and left out."""
    from hexagram.parallel.apply import parallelize

    models: dict[str, tuple[Any, torch.optim.Optimizer]] = {}
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
    return models, failed


def bench_worker(warmup: int, rounds: int, steps: int) -> dict[str, Any]:
    """Every rank, one job: calibrate, plan, apply every plan, then time them round-robin
    (``rounds`` x ``steps`` steps each, after ``warmup``) so load changes hit all alike."""
    import hexagram as hx
    from hexagram.parallel.calibrate import measure_job

    hx.init()
    world = dist.get_world_size()
    model, x, y = build(SPEC)  # the same batch every step (seeded)
    figures = measure_job(SPEC.dtype, model=model, inputs=x, targets=y)
    cluster = model_cluster(figures, world)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box[0] = executable(cluster, world)
    dist.broadcast_object_list(box, src=0)
    plans, skipped = box[0]
    models, failed = _applied(plans, x, y, warmup)
    ref = _Reference(world)
    models[REFERENCE] = (ref, torch.optim.SGD(ref.parameters(), lr=0.01))
    _timed(models[REFERENCE], x, y, warmup)
    # every plan stays alive for the rounds (a training job holds one): the collector's
    # full passes would walk all of their objects during the steps, so park them
    gc.collect()
    gc.freeze()
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, run in models.items():
            # the first step after switching plans runs on caches the other plans
            # filled: untimed, so each plan is timed warm, as it runs when it trains alone
            times[name] += _timed(run, x, y, steps, untimed=1)
    after = measure_job(SPEC.dtype, model=build(SPEC)[0], inputs=x, targets=y)
    return {"figures": figures, "figures_after": after, "times": times,
            "plans": {n: plans[n].to_json(indent=None) for n in models if n in plans},
            "skipped": skipped,
            "failed": failed}


_TERMS = ("compute", "op overhead", "links", "DTensor", "FSDP2", "pipelining", "step",
          "core sharing")


def _row(world: int, name: str, p: Plan, measured_s: float, figures: dict[str, float]
         ) -> dict[str, Any]:
    """One table row: the plan's prediction (and without the model-measured compute scale),
    its split by term, the measurement and the ratio."""
    graph = _graph()
    base = model_cluster(figures, world, scaled=False)
    parts = {"core sharing": 0.0, **breakdown(graph, p, p.cluster)}
    row: dict[str, Any] = {"ranks": world, "name": name, "shape": p.summary().split(":")[0],
           "predicted_ms": p.step_time_s * 1e3,
           "predicted_unscaled_ms": price(graph, p, base) * 1e3,
           "measured_ms": measured_s * 1e3, "ratio": measured_s / p.step_time_s,
           "breakdown_ms": {k: parts[k] * 1e3 for k in _TERMS}, "plan": p.to_json(indent=None)}
    split = " ".join(f"{k} {row['breakdown_ms'][k]:.0f}" for k in _TERMS
                     if abs(row["breakdown_ms"][k]) >= 0.5)
    print("| {ranks} | {name} | {shape} | {predicted_unscaled_ms:.1f} | {predicted_ms:.1f} | "
          "{measured_ms:.1f} | {ratio:.2f} | ".format(**row) + split + " |", flush=True)
    return row


def _verdict(world: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    first = min(rows, key=lambda r: r["predicted_ms"])
    fastest = min(rows, key=lambda r: r["measured_ms"])
    verdict = first["measured_ms"] <= 1.1 * fastest["measured_ms"]
    print(f"# {world} ranks: ranked first {first['name']} ({first['measured_ms']:.1f} ms "
          f"measured), fastest {fastest['name']} ({fastest['measured_ms']:.1f} ms): "
          f"{'within 10%' if verdict else 'NOT within 10%'}", flush=True)
    return {"ranked_first": first["name"], "fastest": fastest["name"],
            "first_within_10pct": verdict}


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
    def measured(name: str) -> float:
        n = len(r0["times"][name])
        return statistics.median(max(r["times"][name][k] for r in res) for k in range(n))

    rows = [_row(world, name, Plan.from_json(text), measured(name), r0["figures"])
            for name, text in r0["plans"].items()]
    during = _during(world, rows, r0["figures"], measured(REFERENCE))
    return {"ranks": world, "load_before": load[0], "load_after": os.getloadavg()[0],
            "figures": r0["figures"], "figures_after": r0["figures_after"], "plans": rows,
            "skipped": r0["skipped"], "failed": r0["failed"], "during_runs": during,
            **_verdict(world, rows)}


def _during(world: int, rows: list[dict[str, Any]], figures: dict[str, float],
            reference_s: float) -> dict[str, Any]:
    """The same plans priced with the compute scale read off the timing rounds (the
    reference step, max over ranks, against the same roofline), next to the measurements:
    a diagnostic of load drift between the calibration and the runs, not the planner's
    prediction."""
    from hexagram.parallel.calibrate import with_model_figures

    scale = reference_s * 1e3 / figures["model_predicted_ms"]
    cluster = with_model_figures(model_cluster(figures, world, scaled=False),
                                 {"compute_scale": scale, "cores": figures.get("cores", 0.0),
                                  "dp_sync_scale": figures.get("dp_sync_scale", 0.0)})
    ratios = {r["name"]: r["measured_ms"] / (price(_graph(), Plan.from_json(r["plan"]),
                                                   cluster) * 1e3) for r in rows}
    print(f"# {world} ranks, diagnostic: reference step during the rounds "
          f"{reference_s * 1e3:.1f} ms = compute scale {scale:.2f} (calibration: "
          f"{figures['compute_scale']:.2f}); priced with it, measured/predicted "
          f"{min(ratios.values()):.2f}-{max(ratios.values()):.2f}, "
          f"{sum(0.67 <= v <= 1.5 for v in ratios.values())} of {len(ratios)} within "
          f"0.67-1.5x", flush=True)
    return {"reference_ms": reference_s * 1e3, "compute_scale": scale, "ratios": ratios}


def calibration_worker(times: int, gap_s: float) -> list[dict[str, float]]:
    """Every rank: the calibration alone, ``times`` times, ``gap_s`` seconds apart."""
    import hexagram as hx
    from hexagram.parallel.calibrate import measure_job

    hx.init()
    model, x, y = build(SPEC)
    out = []
    for k in range(times):
        if k:
            time.sleep(gap_s)
        out.append(measure_job(SPEC.dtype, model=model, inputs=x, targets=y))
    return out


def repeatability(worlds: list[int], times: int, gap_s: float) -> None:
    """``--calibrations``: calibrate ``times`` times per world size and print each."""
    for world in worlds:
        runs = run_local(calibration_worker, world, args=(times, gap_s),
                         timeout=300 + times * (gap_s + 120))[0]
        for k, f in enumerate(runs):
            print(f"# {world} ranks, calibration {k + 1} of {times}: {_brief(f)}", flush=True)


def reprice(path: str) -> list[dict[str, Any]]:
    """Re-predict a stored run: every plan priced again under the stored calibration (the
    model-measured compute scale applied if the run measured it); files without plan text
    are re-planned from the same figures (the planner is deterministic), checked against
    the stored prediction."""
    with open(path) as f:
        stored = json.load(f)
    out = []
    for w in stored["worlds"]:
        world, figures = w["ranks"], w["figures"]
        print(f"# {world} ranks, stored calibration {_brief(figures)}")
        planned = {} if all("plan" in r for r in w["plans"]) else \
            candidates(model_cluster(figures, world), world)
        rows = []
        for r in w["plans"]:
            p = Plan.from_json(r["plan"]) if "plan" in r else planned[r["name"]]
            if p is None or abs(p.step_time_s * 1e3 - r["predicted_ms"]) > \
                    1e-6 * r["predicted_ms"]:
                raise SystemExit(f"{path}: plan {r['name']!r} cannot be rebuilt (stored "
                                 f"prediction {r['predicted_ms']:.3f} ms)")
            rows.append(_row(world, r["name"], p, r["measured_ms"] / 1e3, figures))
        out.append({"ranks": world, "plans": rows, **_verdict(world, rows)})
    return out


def _brief(f: dict[str, float]) -> str:
    scale = (f"; model step {f['model_step_ms']:.1f} ms measured (rank 0 alone "
             f"{f.get('model_step_alone_ms', float('nan')):.1f} ms) / "
             f"{f['model_predicted_ms']:.1f} ms roofline = compute scale "
             f"{f['compute_scale']:.2f}, cores {f.get('cores', 0.0):.2f}") if "compute_scale" in f \
        else ""
    if "work_scale" in f:
        scale += (f"; whole batch per rank {f['model_step_whole_batch_ms']:.1f} ms: work "
                  f"scale {f['work_scale']:.2f}, per-operator scale {f['op_scale']:.2f}")
    if "dp_sync_ms" in f:
        scale += (f"; dp sync of the model's gradients {f['dp_sync_ms']:.1f} ms = "
                  f"{f['dp_sync_scale']:.2f}x its alpha-beta price")
    return (f"{f['device_tflops'] * 1e3:.1f} GFLOP/s, {f['op_overhead_us']:.0f} us/op, link "
            f"{f['latency_us']:.0f} us + {f['gbps']:.2f} Gbit/s, DTensor "
            f"{f['tp_overhead_us']:.0f} us/linear, FSDP2 {f['zero_overhead_us']:.0f} us/unit, "
            f"pipelining {f['microbatch_overhead_us']:.0f} us/micro-batch, step "
            f"{f['step_overhead_us']:.0f} us" + scale)


def _summary(results: list[dict[str, Any]]) -> None:
    ratios = [r["ratio"] for res in results for r in res["plans"]]
    print(f"# measured/predicted {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} plans; "
          f"{sum(0.67 <= v <= 1.5 for v in ratios)} within 0.67-1.5x")


_HEADER = ("| ranks | plan | shape | predicted ms, microbenchmarks only | predicted ms | "
           "measured ms | measured/predicted | predicted split (ms) |\n"
           "|---|---|---|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per plan and round")
    parser.add_argument("--json", default=None)
    parser.add_argument("--reprice", default=None, metavar="JSON",
                        help="re-predict a stored run's plans (nothing is executed)")
    parser.add_argument("--calibrations", type=int, default=0, metavar="K",
                        help="only calibrate, K times per world size (repeatability)")
    parser.add_argument("--gap", type=float, default=60.0,
                        help="seconds between --calibrations")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.calibrations:
        repeatability(args.worlds, args.calibrations, args.gap)
        return
    if args.reprice:
        print(_HEADER)
        _summary(reprice(args.reprice))
        return
    print(f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, "
          f"torch {torch.__version__}; GPT {SPEC.layers} blocks, hidden {SPEC.hidden}, seq "
          f"{SPEC.seq}, vocab {SPEC.vocab}, batch {SPEC.batch}, float64; "
          f"{args.warmup} warm-up steps, then {args.rounds} rounds x (1 untimed + "
          f"{args.steps} timed) steps of every plan in turn")
    print(_HEADER)
    results = [run_world(w, args.warmup, args.rounds, args.steps) for w in args.worlds]
    _summary(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "benchmarks/plan_calibration.py", "worlds": results}, f,
                      indent=1, default=str)


if __name__ == "__main__":
    main()
