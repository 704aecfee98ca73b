"""``hexagram bench``: step time of algorithms against PyTorch DDP on emulated networks.

Example:
    $ hexagram bench --hosts 4 --bandwidth 100mbit --model mlp \\
        --algorithms ddp,ddp-fp16,allreduce,bytegrad,gtopk --steps 20 \\
        --json out.json --plot out.png

Each ``--bandwidth`` value (comma-separated) builds a fresh lab; on it, every algorithm runs
in turn with the same model, batch and seed. ``--loopback`` runs without the lab (no root
needed, no shaping, no link counters).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from hexagram.bench.harness import LoopbackLab, check_algorithms, machine_info, run_task
from hexagram.bench.lab import LabConfig, LabUnavailableError, NetworkLab, parse_rate
from hexagram.bench.peers import PEERS
from hexagram.bench.report import (
    markdown_table,
    plot_throughput,
    summarize_outcome,
    write_outputs,
)
from hexagram.cli_options import add, nonnegative_int, positive_float, positive_int
from hexagram.errors import require
from hexagram.models.workload import MODELS

__all__ = ["add_arguments", "add_lab_arguments", "add_model_arguments", "algorithm_list",
           "known_algorithms", "parse_settings", "run", "run_bench",
           "split_label"]


def algorithm_list(text: str) -> list[str]:
    """``"ddp,allreduce"`` -> names; ``"all"``: PyTorch peers and every registered one."""
    from hexagram.algorithms import names

    if text.strip() == "all":
        return [*PEERS, *names()]
    return [t.strip() for t in text.split(",") if t.strip()]


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def split_label(label: str) -> tuple[str, dict[str, Any]]:
    """``"allreduce:hierarchical=true"`` -> ``("allreduce", {"hierarchical": True})``, so
    one run can compare configurations of the same algorithm."""
    name, *pairs = label.split(":")
    config = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"algorithm {label!r}: expected NAME:FIELD=VALUE[:FIELD=VALUE]")
        config[key] = _value(value)
    return name, config


def parse_settings(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["qsgd.levels=16"]`` -> ``{"qsgd": {"levels": 16}}`` (values parsed as JSON)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        algo, dot, field = key.partition(".")
        if not sep or not dot:
            raise SystemExit(f"--set {item!r}: expected ALGORITHM.FIELD=VALUE")
        out.setdefault(algo, {})[field] = _value(value)
    return out


def known_algorithms() -> list[str]:
    """The names ``--algorithms`` takes in ``bench`` and ``train``: PyTorch's peers and
    every registered algorithm."""
    from hexagram.algorithms import names

    return [*PEERS, *names()]


def add_model_arguments(parser: argparse.ArgumentParser, params: int, layers: int,
                        width: int) -> None:
    """``--model --params --layers --width --seq`` of the lab commands (bench, train,
    advise); ``--block`` is the old spelling of ``--seq``."""
    add(parser, "model", choices=MODELS, default="mlp")
    add(parser, "params", default=params)
    add(parser, "layers", default=layers)
    add(parser, "width", default=width)
    add(parser, "seq", default=64, aliases=("block",))


def add_lab_arguments(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--hosts --ranks-per-host --bandwidth --loopback``: the emulated network."""
    add(parser, "hosts", default=4)
    add(parser, "ranks-per-host", default=1)
    add(parser, "bandwidth", default="100mbit", parse=parse_rate, note=note)
    add(parser, "loopback")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``hexagram bench``."""
    add_lab_arguments(parser, note="comma-separated: one lab per rate")
    add_model_arguments(parser, params=6_300_000, layers=3, width=256)
    add(parser, "algorithms", default="ddp,ddp-fp16,allreduce", known=known_algorithms,
        note="or 'all' (PyTorch peers + every registered algorithm); NAME:FIELD=VALUE sets a "
        "config field, e.g. allreduce:hierarchical=true")
    add(parser, "set", default=[])
    add(parser, "batch", default=32)
    add(parser, "steps", default=20, note="timed steps per algorithm (at most)")
    a = parser.add_argument
    a("--min-steps", type=positive_int, default=3,
      help="timed steps at least, whatever --time-limit")
    a("--warmup", type=nonnegative_int, default=3, help="untimed steps first")
    add(parser, "time-limit", default=120.0,
        note="of timed steps: fewer steps when they are slow")
    a("--rounds", type=positive_int, default=1,
      help="run the algorithm list this many times, alternating; report the median round")
    add(parser, "lr", default=0.01)
    add(parser, "bucket-mb", note="for every library in the run, PyTorch DDP's included "
        "(default: each one's own, 25; 0: one tensor per bucket)")
    add(parser, "threads", default=1)
    add(parser, "timeout", default=900.0)
    a("--stall-timeout", type=positive_float, default=90.0,
      help="a rank that makes no progress this long ends with a 'hung' error")
    add(parser, "json")
    add(parser, "plot", note="throughput against bandwidth")
    add(parser, "markdown")
    a("--quiet", action="store_true", help="no progress bar")


def _spec(args: argparse.Namespace, label: str,
          settings: dict[str, dict[str, Any]]) -> dict[str, Any]:
    name, config = split_label(label)
    return {"task": "step", "algorithm": name, "label": label,
            "config": {**settings.get(name, {}), **config},
            "model": {"name": args.model, "params": args.params, "layers": args.layers,
                      "width": args.width, "block": args.seq},
            "steps": args.steps, "min_steps": args.min_steps, "warmup": args.warmup,
            "time_limit": args.time_limit, "batch": args.batch, "lr": args.lr, "seed": 0,
            "bucket_mb": args.bucket_mb,
            "stall_timeout": args.stall_timeout}


def _progress(total: int, quiet: bool) -> Any:
    rich = require("rich.progress", extra="bench", feature="hexagram bench's progress display")
    progress = rich.Progress(rich.TextColumn("{task.description}"), rich.BarColumn(),
                             rich.TextColumn("{task.completed}/{task.total}"),
                             rich.TimeElapsedColumn(), disable=quiet, transient=True)
    progress.add_task("bench", total=total)
    return progress


def _run_bandwidth(args: argparse.Namespace, bandwidth: str, names: list[str],
                   settings: dict[str, dict[str, Any]], progress: Any) -> list[dict[str, Any]]:
    """Every algorithm, ``args.rounds`` times alternating, on one fresh lab."""
    config = LabConfig(hosts=args.hosts, ranks_per_host=args.ranks_per_host,
                       bandwidth="unshaped" if args.loopback else bandwidth)
    lab_cls: Any = LoopbackLab if args.loopback else NetworkLab
    task = progress.task_ids[0]
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with lab_cls(config) as lab:
        for _ in range(args.rounds):  # alternate algorithms: load drift hits all alike
            for name in names:
                progress.update(task, description=f"{bandwidth}: {name}")
                outcome = run_task(lab, _spec(args, name, settings), timeout=args.timeout,
                                   threads=args.threads)
                rounds[name].append(summarize_outcome(outcome, config.rate, args.batch,
                                                      config.world_size))
                progress.advance(task)
    return [_median_round(r) for r in rounds.values()]


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every algorithm on every bandwidth; return the report (see ``--json``)."""
    names = algorithm_list(args.algorithms)
    settings = parse_settings(args.set)
    bandwidths = [b.strip() for b in args.bandwidth.split(",") if b.strip()]
    for b in bandwidths:
        parse_rate(b)
    if args.loopback:  # no links to shape: one unshaped run, labelled as what it is
        bandwidths = ["loopback"]
    report: dict[str, Any] = {"machine": machine_info(), "settings": vars(args).copy(),
                              "missing": check_algorithms([split_label(n)[0] for n in names]),
                              "results": {}}
    progress = _progress(len(names) * len(bandwidths) * args.rounds, args.quiet)
    with progress:
        for bw in bandwidths:
            report["results"][bw] = _run_bandwidth(args, bw, names, settings, progress)
            write_outputs(report, "", args.json, None)  # partial results survive a stop
    report["machine"]["load_average_end"] = machine_info()["load_average"]
    return report


def _median_round(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median step time (a failure if any round failed), with every
    round's step time."""
    failed = [r for r in rows if "error" in r]
    if failed:
        return failed[0]
    ordered = sorted(rows, key=lambda r: r["step_s"])
    return {**ordered[(len(ordered) - 1) // 2], "rounds_step_s": [r["step_s"] for r in rows]}


def _print_report(report: dict[str, Any], args: argparse.Namespace) -> str:
    out = []
    params = next((r["num_params"] for rows in report["results"].values() for r in rows
                   if "num_params" in r), None)
    for bw, rows in report["results"].items():
        out.append(f"\n### {args.hosts} hosts x {args.ranks_per_host} rank(s), {bw} links, "
                   f"{args.model} ({params or '?'} parameters), batch {args.batch}/rank"
                   + ("" if args.bucket_mb is None else f", buckets {args.bucket_mb:g} MB")
                   + "\n")
        out.append(markdown_table(rows))
    for name, why in report["missing"].items():
        out.append(f"\nmissing: {name}: {why}")
    machine = report["machine"]
    out.append(f"\nmachine: {machine['cpu']} ({machine['cores']} cores), torch "
               f"{machine['torch']}, load average {machine['load_average']} -> "
               f"{machine['load_average_end']}")
    text = "\n".join(out)
    print(text)
    return text


def run(args: argparse.Namespace) -> int:
    """Run ``hexagram bench``; 0 when every algorithm ran, 1 when some failed, 2 when the
    lab is unavailable (a bad argument stops at the parser: one line, exit code 2)."""
    try:
        report = run_bench(args)
    except LabUnavailableError as exc:
        print(f"hexagram bench: {exc}", file=sys.stderr)
        return 2
    text = _print_report(report, args)
    write_outputs(report, text, args.json, args.markdown)
    if args.plot:
        plot_throughput(report["results"], args.plot,
                        title=f"{args.model}, {args.hosts} hosts: samples/s against bandwidth")
    failed = any("error" in r for rows in report["results"].values() for r in rows)
    return 1 if failed else 0
