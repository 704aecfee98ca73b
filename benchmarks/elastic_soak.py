"""Soak benchmark of live elastic training: Hexagram's live mode and torchft side by side.

Both train the same MLP on Fashion-MNIST (digits when it is absent) with the same global
batch per step, ``--world`` replicas on gloo on this host; a replica is SIGKILLed at each
``--kill`` step and restarted 1 s later. Reported per run: committed steps lost, dropped
attempts, stall per failure (Hexagram: measured by the trainer from the abort decision;
both: the longest step of a survivor, which contains the failure), healing, the median
step (failure-free runs: the per-step price of each engine), and the final test accuracy
against the same engine's failure-free run. With ``--seeds 0,1,2`` every run, with and
without failures, is repeated per seed (initial weights and data order), and a summary
gives per engine and algorithm the mean +- sd of both accuracies and of the per-seed
differences (with failures minus failure-free: the difference of the means). At 600 steps
the accuracy of one seed moves by 1-4 points between runs that differ only in float
rounding or in when a replica rejoins, and by 3 points between seeds: compare paired means
over several seeds, not single runs.

torchft (0.2.0, a benchmark-only dependency: ``pip install "torch==2.13.0"
"torchft==0.2.0"``) runs a Lighthouse in this process and one Manager per replica
(``ProcessGroupGloo``, its ``DistributedDataParallel`` and ``OptimizerWrapper``, the
asynchronous quorum of its examples, a static data shard per replica as its
``DistributedSampler`` gives); without torchft only Hexagram runs.

    python benchmarks/elastic_soak.py --world 4 --no-torchft --seeds 0,1,2 \\
        --json benchmarks/results/elastic_soak_seeds.json

Timings on a shared machine are noisy; say so where they are published.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hexagram.bench import soak
from hexagram.elastic.residuals import check_policy
from hexagram.errors import require
from hexagram.launch import supervise
from hexagram.testing.faults import parse_faults


def _torchft_replica(replica: int, world: int, lighthouse: str, cfg: dict[str, Any],
                     incarnation: int, out: str, barrier: Any) -> None:
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    torch.set_num_threads(1)
    data = soak._data(cfg["dataset"])
    model = soak.model_for(data, seed=cfg["seed"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=cfg["timeout"])),
        min_replica_size=cfg["min_size"],  # async quorum (its default), overlapping forward
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    opt.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        replica_id=f"replica{replica}", store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=lighthouse,
        timeout=timedelta(seconds=cfg["timeout"]))
    ddp, optim = DistributedDataParallel(manager, model), OptimizerWrapper(manager, opt)
    if not incarnation:  # all start together, as Hexagram's replicas do: no late joiner
        barrier.wait(cfg["timeout"])
    injector = soak.injector_for(cfg["kill"], replica, incarnation)
    report: dict[str, Any] = {"restarted": incarnation > 0, "log": [], "times": []}
    while manager.current_step() < cfg["steps"]:
        injector.at_step(manager.current_step())
        start = time.perf_counter()
        optim.zero_grad()  # starts the quorum
        step = manager.current_step()
        # torchft's own way: a static shard per replica (its DistributedSampler), so the
        # quorum overlaps forward; a dead replica's share of the step is skipped
        x, y = soak.global_batch(data, step, replica, world, world, cfg["batch"],
                                 cfg["seed"])
        F.cross_entropy(ddp(x), y).backward()
        optim.step()  # steps only if the manager's commit vote passed
        if manager.current_step() > step:
            report["log"].append(step)
        report["times"].append(time.perf_counter() - start)
    report.update(step=manager.current_step(), accuracy=soak.accuracy(model, data),
                  stats={})
    torch.save(report, Path(out) / f"replica{replica}_{incarnation}.pt")
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's threads would keep the process alive


def run_torchft(world: int, steps: int, kill: str, dataset: str, batch: int, lr: float,
                heartbeat_ms: int, deadline: float, min_size: int,
                seed: int = 0) -> dict[str, Any]:
    """The torchft soak: :func:`hexagram.bench.soak.run_soak`'s protocol on torchft."""
    require("torchft", extra="elastic-bench", feature="the torchft side of the soak")
    from torchft.coordination import LighthouseServer

    os.environ.setdefault("RUST_LOG", "error")  # torchft logs every quorum at info
    soak._data(dataset)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_size,
                                  join_timeout_ms=1000, quorum_tick_ms=10,
                                  heartbeat_timeout_ms=heartbeat_ms)
    cfg = {"steps": steps, "kill": kill, "dataset": dataset, "batch": batch, "lr": lr,
           "min_size": min_size, "timeout": 30.0, "seed": seed}
    # spawn, not fork: forking a parent that runs the Lighthouse (a Rust runtime) and has
    # run gloo left some replicas deadlocked before they reached the quorum
    ctx = mp.get_context("spawn")
    started, barrier = time.perf_counter(), ctx.Barrier(world)
    with tempfile.TemporaryDirectory() as out:
        def start(r: int, incarnation: int) -> Any:
            return ctx.Process(target=_torchft_replica, args=(
                r, world, lighthouse.address(), cfg, incarnation, out, barrier))

        procs = {r: start(r, 0) for r in range(world)}
        for proc in procs.values():
            proc.start()
        in_time = supervise(procs, start, Counter(f.rank for f in parse_faults(kill)), 1.0,
                             time.monotonic() + deadline)
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        lighthouse.shutdown()
        codes = {r: p.exitcode for r, p in procs.items()}
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"torchft soak failed: exit codes {codes}")
        reports = {f.name[7:-3]: torch.load(f, weights_only=False)
                   for f in Path(out).glob("*.pt")}
    row = soak.summarize(reports, steps, kill, time.perf_counter() - started)
    row["completed_in_time"] = in_time
    return row


def _spread(values: list[float]) -> str:
    """``median / max (n)`` of a list of seconds, ``-`` when empty."""
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} / {max(values):.2f} ({len(values)})"


def _cells(r: dict[str, Any], plain_ms: float | None) -> list[str]:
    overhead = (f"{r['median_step_ms'] - plain_ms:+.1f}"
                if plain_ms is not None and not r.get("kills") else "-")
    agree = r.get("accuracy_spread")
    if r.get("replicas_identical") is not None:  # parameter hashes (rows since 2026-11-26)
        agree = 0 if r["replicas_identical"] else f"no (accuracy spread {agree})"
    return [str(r.get("steps_lost", "-")), str(r.get("dropped_attempts", "-")),
            _spread(r.get("stall_s", [])),
            f"{r['longest_step_s']:.2f}" if "longest_step_s" in r else "-",
            _spread(r.get("heal_s", [])), f"{r['median_step_ms']:.1f}", overhead,
            f"{r['accuracy']:.4f}", "yes" if agree == 0 else str(agree),
            str(r.get("rejoined", "-")), f"{r['wall_s']:.0f}" if "wall_s" in r else "-"]


def markdown(rows: list[dict[str, Any]]) -> str:
    """The results as a table: one line per engine, algorithm, failure setting and seed.
    Stall and healing: median / max (count) in seconds; overhead: the failure-free median
    step minus plain PyTorch DDP's (the first row)."""
    head = ["engine", "algorithm", "kills", "seed", "steps lost", "dropped attempts",
            "stall per failure (s)", "longest step (s)", "healing (s)", "median step (ms)",
            "overhead vs plain DDP (ms)", "final accuracy", "replicas agree", "rejoined",
            "wall (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    plain_ms = next((r["median_step_ms"] for r in rows if r["engine"].startswith("pytorch")
                     and "error" not in r), None)
    for r in rows:
        engine = r["engine"] + (f", residuals {r['residuals']}" if "residuals" in r else "")
        first = (f"| {engine} | {r['algorithm']} | {r['kill'] or 'none'} "
                 f"| {r.get('seed', 0)} | ")
        if "error" in r:
            lines.append(first + f"{r['error']} |" + " |" * (len(head) - 5))
        else:
            lines.append(first + " | ".join(_cells(r, plain_ms)) + " |")
    return "\n".join(lines)


def _mean_sd(values: list[float]) -> str:
    """``mean +- sample sd`` in accuracy points (``-`` when empty)."""
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.2f} +- {100 * sd:.2f}"


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per engine and algorithm, over the seeds run both with and without failures: the
    final accuracies of each setting, their means, and the per-seed (paired) differences
    *with failures minus failure-free* (the same seed: the same initial weights and data
    order), whose mean is the difference of the means."""
    runs: dict[tuple[str, str, str], dict[int, dict[str, float]]] = {}
    for r in rows:
        if "error" in r or r.get("accuracy") is None:
            continue
        setting = "failures" if r["kill"] else "free"
        key = (r["engine"], r["algorithm"], r.get("residuals", "-"))
        runs.setdefault(key, {}).setdefault(r.get("seed", 0), {})[setting] = r["accuracy"]
    out = []
    for (engine, algorithm, residuals), by_seed in runs.items():
        both = sorted(s for s, v in by_seed.items() if len(v) == 2)
        free = [by_seed[s]["free"] for s in both]
        failed = [by_seed[s]["failures"] for s in both]
        out.append({"engine": engine, "algorithm": algorithm, "residuals": residuals,
                    "seeds": both,
                    "free": free, "failures": failed,
                    "differences": [b - a for a, b in zip(free, failed)]})
    return out


def summary_markdown(summaries: list[dict[str, Any]]) -> str:
    """:func:`summary` as a table, accuracies in points: mean +- sample sd over seeds."""
    head = ["engine", "algorithm", "residuals", "seeds", "failure-free", "with failures",
            "difference (paired, per seed)", "difference of means"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        if not s["seeds"]:
            continue
        diffs = ", ".join(f"{100 * d:+.2f}" for d in s["differences"])
        mean_diff = 100 * statistics.mean(s["differences"])
        lines.append(f"| {s['engine']} | {s['algorithm']} | {s['residuals']} "
                     f"| {len(s['seeds'])} | "
                     f"{_mean_sd(s['free'])} | {_mean_sd(s['failures'])} | "
                     f"{_mean_sd(s['differences'])} ({diffs}) | {mean_diff:+.2f} |")
    return "\n".join(lines)


def _torchft_available() -> str | None:
    try:
        require("torchft", extra="elastic-bench", feature="the torchft side of the soak")
    except ImportError as exc:
        return str(exc)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--kill", default="1@100,2@200,3@300,1@400,2@500")
    parser.add_argument("--min-size", type=int, default=2,
                        help="replicas a step needs (both engines); at most two are down "
                             "at once with a kill every 100 steps and 1 s restarts")
    parser.add_argument("--algorithms", default="allreduce,powersgd,diloco")
    parser.add_argument("--dataset", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--torchft-heartbeat-ms", type=int, default=1000,
                        help="torchft Lighthouse heartbeat timeout (its default is 5000)")
    parser.add_argument("--no-torchft", action="store_true")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated seeds (initial weights and data order); every "
                             "run, with and without failures, is repeated per seed")
    parser.add_argument("--residuals", default="reset",
                        help="live mode's error-feedback residuals at a membership change: "
                             "reset (default), mean or own (hexagram.elastic.residuals)")
    parser.add_argument("--deadline", type=float, default=900.0)
    parser.add_argument("--json")
    parser.add_argument("--markdown", help="also write the tables here")
    parser.add_argument("--summarize", nargs="+", metavar="JSON",
                        help="run nothing: combine the rows of these --json files (e.g. "
                             "runs of other seeds or residual policies) into the tables")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    if args.summarize:
        rows = combine(args.summarize)
        _write(args, rows)
        return

    def record(engine: str, algorithm: str, kill: str, seed: int,
               row: dict[str, Any]) -> None:
        rows.append({"engine": engine, "algorithm": algorithm, "kill": kill, "seed": seed,
                     **row})
        print(json.dumps(rows[-1], default=str), flush=True)
        if engine == "hexagram":
            rows[-1]["residuals"] = args.residuals
        print(json.dumps(rows[-1], default=str), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"load_average": os.getloadavg(), "args": vars(args), "rows": rows,
                 "summary": summary(rows)}, indent=1, default=str))

    check_policy(args.residuals)
    for seed in _seeds(args.seeds):
        _run_seed(args, seed, record)
    _write(args, rows, json_too=False)


def combine(paths: list[str]) -> list[dict[str, Any]]:
    """The rows of several ``--json`` files; a Hexagram row without a ``residuals`` field
    gets its file's ``--residuals`` (``"own"`` for files written before that option: the
    only behaviour then)."""
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        policy = data.get("args", {}).get("residuals", "own")
        for row in data["rows"]:
            if row["engine"] == "hexagram":
                row.setdefault("residuals", policy)
            rows.append(row)
    return rows


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], json_too: bool = True
           ) -> None:
    tables = markdown(rows) + "\n\n" + summary_markdown(summary(rows))
    print(tables)
    if args.markdown:
        Path(args.markdown).write_text(tables + "\n")
    if args.json and json_too:
        Path(args.json).write_text(json.dumps(
            {"combined_from": args.summarize, "rows": rows, "summary": summary(rows)},
            indent=1, default=str))


def _seeds(spec: str) -> list[int]:
    try:
        seeds = [int(x) for x in spec.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds {spec!r}: give comma-separated integers, e.g. 0,1,2") \
            from None
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise SystemExit(f"--seeds {spec!r}: give distinct non-negative integers")
    return seeds


def _run_seed(args: argparse.Namespace, seed: int, record: Any) -> None:
    """Every engine's runs for one seed: plain DDP, Hexagram per algorithm and torchft,
    each without and with the failures."""
    plain = soak.plain_ddp(args.world, args.steps, args.dataset, args.batch, args.lr,
                           seed=seed)
    record("pytorch-ddp (no fault tolerance)", "allreduce", "", seed, plain)
    for algorithm in args.algorithms.split(","):
        for kill in ("", args.kill):
            record("hexagram", algorithm, kill, seed, soak.run_soak(
                args.world, args.steps, kill, algorithm, None, args.dataset, args.batch,
                args.lr, min_size=args.min_size, deadline=args.deadline, seed=seed,
                residuals=args.residuals))
    missing = "skipped (--no-torchft)" if args.no_torchft else _torchft_available()
    for kill in ("", args.kill):
        if missing:
            record("torchft", "allreduce", kill, seed, {"error": missing})
            continue
        record("torchft", "allreduce", kill, seed, run_torchft(
            args.world, args.steps, kill, args.dataset, args.batch, args.lr,
            args.torchft_heartbeat_ms, args.deadline, args.min_size, seed))


if __name__ == "__main__":
    main()
