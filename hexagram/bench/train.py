"""``hexagram train``: time to accuracy of each algorithm on real data, same network.

Example:
    $ hexagram train --hosts 4 --bandwidth 100mbit --dataset fashion-mnist \\
        --algorithms ddp,allreduce,bytegrad --target 0.84 --epochs 3 \\
        --json tta.json --plot tta.png

Images: Fashion-MNIST (Debian package ``dataset-fashion-mnist``) or scikit-learn's digits
(``--dataset auto`` picks the first available); the metric is test accuracy. ``--dataset
text`` trains a small GPT on Python's documentation; the metric is validation loss.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hexagram.bench import robust as robust_harness
from hexagram.bench.cli import (
    add_lab_arguments,
    add_model_arguments,
    algorithm_list,
    known_algorithms,
    parse_settings,
    split_label,
)
from hexagram.bench.harness import LoopbackLab, check_algorithms, machine_info, run_task
from hexagram.bench.lab import LabConfig, LabUnavailableError, NetworkLab
from hexagram.bench.report import write_outputs
from hexagram.cli_options import add, checked, fail, positive_int
from hexagram.errors import require
from hexagram.testing.faults import parse_faults

__all__ = ["add_arguments", "markdown_table", "plot_curves", "run", "run_train"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``hexagram train``."""
    add_lab_arguments(parser)
    add(parser, "dataset", choices=("fashion-mnist", "digits", "auto", "text"),
        default="auto", note="auto: Fashion-MNIST when installed, else digits; text: a "
        "small GPT on Python's documentation")
    add_model_arguments(parser, params=1_000_000, layers=2, width=128)
    add(parser, "algorithms", default="ddp,allreduce", known=known_algorithms,
        note="NAME:FIELD=VALUE sets a config field")
    add(parser, "set", default=[])
    add(parser, "epochs", default=3)
    a = parser.add_argument
    a("--target", type=float, default=None,
      help="stop at this test accuracy (images) or validation loss (text)")
    a("--evals-per-epoch", type=positive_int, default=4, help="evaluations per epoch")
    add(parser, "batch", default=64)
    add(parser, "lr", note="default 0.05 (SGD, images) / 3e-3 (AdamW, text)")
    add(parser, "time-limit", default=600.0, note="of training")
    add(parser, "bucket-mb", note="for every library in the run, PyTorch DDP's included "
        "(default: each one's own, 25; 0: one tensor per bucket)")
    add(parser, "threads", default=1)
    a("--seed", type=int, default=0,
      help="model initialization, data order and the non-IID split (--partition dirichlet)")
    add(parser, "timeout", default=1800.0)
    a("--kill", type=checked(parse_faults), default="", metavar="RANK@STEP[:ACTION][,...]",
      help="fault injection: RANK fails at training STEP (action sigkill by default; exit, "
      "sigstop, raise); without --live the report shows how the run ended (restart with "
      "torchrun --max-restarts and hexagram.load_checkpoint)")
    a("--live", action="store_true",
      help="live mode (hexagram.elastic.live) on loopback: the survivors keep training "
      "when --kill fails a replica, which restarts and heals; reports steps lost, stall, "
      "healing and final accuracy (hexagram.bench.soak)")
    add(parser, "steps", default=300, note="training steps with --live")
    add(parser, "json")
    add(parser, "plot", note="accuracy (or loss) against time")
    add(parser, "markdown")
    robust_harness.add_arguments(parser)  # --byzantine, --attack, --partition, --alpha


def _spec(args: argparse.Namespace, label: str, settings: dict[str, Any]) -> dict[str, Any]:
    text = args.dataset == "text"
    name, config = split_label(label)
    return {"task": "train", "algorithm": name, "label": label,
            "config": {**settings.get(name, {}), **config},
            "dataset": args.dataset, "epochs": args.epochs, "target": args.target,
            "model": {"name": "gpt" if text else args.model, "params": args.params,
                      "layers": args.layers, "width": args.width, "block": args.seq},
            "evals_per_epoch": args.evals_per_epoch, "batch": args.batch,
            "lr": args.lr if args.lr is not None else (3e-3 if text else 0.05),
            "time_limit": args.time_limit, "seed": args.seed, "bucket_mb": args.bucket_mb,
            "faults": args.kill,
            **robust_harness.spec_fields(args)}


def _summary(name: str, ranks: list[dict[str, Any]], error: str | None) -> dict[str, Any]:
    if error is not None:
        return {"algorithm": name, "error": error}
    r0 = ranks[0]
    curve, reached = r0["curve"], r0["reached"]
    last = curve[-1]
    return {"algorithm": name, "metric": r0["metric"], "curve": curve, "reached": reached,
            "final": last["metric"], "epochs": last["epoch"], "time_s": last["time_s"],
            "s_per_epoch": last["time_s"] / max(last["epoch"], 1e-9),
            "num_params": r0["num_params"],
            "bytes_per_step": max(r["bytes_sent"] for r in ranks) / max(1, r0["steps"])}


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    """Train with every algorithm on one lab; return the report."""
    if args.dataset == "auto":
        from hexagram.data import fashion_mnist_available

        args.dataset = "fashion-mnist" if fashion_mnist_available() else "digits"
    names = algorithm_list(args.algorithms)
    parse_faults(args.kill)  # a malformed --kill fails here, before any rank starts
    settings = parse_settings(args.set)
    config = LabConfig(hosts=args.hosts, ranks_per_host=args.ranks_per_host,
                       bandwidth="unshaped" if args.loopback else args.bandwidth)
    report: dict[str, Any] = {"machine": machine_info(), "settings": vars(args).copy(),
                              "missing": check_algorithms([split_label(n)[0] for n in names]),
                              "results": []}
    lab_cls: Any = LoopbackLab if args.loopback else NetworkLab
    with lab_cls(config) as lab:
        for name in names:
            print(f"training with {name} ...", file=sys.stderr, flush=True)
            outcome = run_task(lab, _spec(args, name, settings), timeout=args.timeout,
                               threads=args.threads)
            report["results"].append(_summary(name, outcome.ranks, outcome.error))
            if args.json:  # partial results survive an interrupted run
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1)
    report["machine"]["load_average_end"] = machine_info()["load_average"]
    return report


def markdown_table(rows: list[dict[str, Any]], reference: str = "ddp") -> str:
    """Time-to-target table; ``vs ddp`` = ddp's time to target / this one's."""
    ref = next((r for r in rows if r["algorithm"] == reference and r.get("reached")), None)
    lines = ["| algorithm | metric | final | best | time to target (s) | epochs to target | "
             "s/epoch | vs ddp | MB/step sent |", "|" + "---|" * 9]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['algorithm']} | failed: {r['error']} |" + " |" * 7)
            continue
        values = [p["metric"] for p in r["curve"]]
        best = min(values) if r["metric"] == "valid_loss" else max(values)
        hit = r["reached"]
        ratio = f"{ref['reached']['time_s'] / hit['time_s']:.1f}x" if ref and hit else "-"
        lines.append(
            f"| {r['algorithm']} | {r['metric']} | {r['final']:.4f} | {best:.4f} | "
            f"{hit['time_s']:.1f} | {hit['epoch']:.2f} | " if hit else
            f"| {r['algorithm']} | {r['metric']} | {r['final']:.4f} | {best:.4f} | not reached "
            f"| - | ")
        lines[-1] += f"{r['s_per_epoch']:.1f} | {ratio} | {r['bytes_per_step'] / 1e6:.3f} |"
    return "\n".join(lines)


def plot_curves(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Metric against wall time (left) and against epochs (right), one line per algorithm."""
    matplotlib = require("matplotlib", extra="bench", feature="plotting")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for r in rows:
        if "error" in r:
            continue
        style = "--" if r["algorithm"].startswith("ddp") else "-"
        xs_t = [p["time_s"] for p in r["curve"]]
        xs_e = [p["epoch"] for p in r["curve"]]
        ys = [p["metric"] for p in r["curve"]]
        left.plot(xs_t, ys, style, marker=".", label=r["algorithm"])
        right.plot(xs_e, ys, style, marker=".", label=r["algorithm"])
    metric = next((r["metric"] for r in rows if "metric" in r), "metric")
    for ax, xlabel in ((left, "training wall time (s)"), (right, "epochs")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric.replace("_", " "))
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.suptitle(title or "Time to accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run ``hexagram train``; 1 if an algorithm failed, 2 if the lab is unavailable."""
    try:
        robust_harness.spec_fields(args)  # a bad --attack or --byzantine: before any lab
    except (SystemExit, ValueError) as exc:
        return fail("hexagram train", exc.code if isinstance(exc, SystemExit) else exc)
    if args.live:
        from hexagram.bench.soak import train_cli

        return train_cli(args)
    try:
        report = run_train(args)
    except LabUnavailableError as exc:
        print(f"hexagram train: {exc}", file=sys.stderr)
        return 2
    links = "loopback (unshaped)" if args.loopback else f"{args.bandwidth} links"
    text = (f"\n### {args.dataset}, {args.hosts} hosts, {links}, target "
            f"{args.target}\n\n" + markdown_table(report["results"]))
    for name, why in report["missing"].items():
        text += f"\nmissing: {name}: {why}"
    m = report["machine"]
    text += (f"\n\nmachine: {m['cpu']} ({m['cores']} cores), torch {m['torch']}, load average "
             f"{m['load_average']} -> {m['load_average_end']}")
    print(text)
    write_outputs(report, text, args.json, args.markdown)
    if args.plot:
        plot_curves(report["results"], args.plot,
                    title=f"{args.dataset}, {args.hosts} hosts at "
                          f"{'loopback' if args.loopback else args.bandwidth}")
    return 1 if any("error" in r for r in report["results"]) else 0
