"""Robustness benchmark: final test accuracy of each algorithm under each attack.

Runs ``hexagram train`` (loopback, Fashion-MNIST) once per attack with the same algorithm
list, the last ``--byzantine`` ranks attacking, and writes a JSON with every run (and every
rank's outcome: exit code, error class and step where it failed), a Markdown table (final
accuracy per attack x algorithm, or the error every rank raised; step time and MB sent per
step) and a plot of the accuracy curves under the worst attack (the one with the lowest
mean final accuracy).

Example (the reduced configuration of docs/benchmarks/robust.md):
    $ PYTHONPATH=. python benchmarks/robust.py --hosts 5 --byzantine 1 --partition iid \\
        --attacks none,sign_flip,scale,alie,ipm,nan --epochs 1 --params 100000 \\
        --algorithms allreduce,robust:aggregator=trimmed_mean,robust:aggregator=median \\
        --json benchmarks/results/robust_iid.json --markdown robust_iid.md --plot iid.png
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hexagram.bench import robust_run, train

ROBUST_ALGOS = ",".join(["allreduce"] + [f"robust:aggregator={a}" for a in (
    "trimmed_mean", "median", "krum", "multikrum", "geomed", "centered_clip")])


def with_f(algorithms: str, f: int) -> str:
    """``algorithms`` with ``:f=F`` added to every ``robust`` entry that does not set ``f``
    (the config default is 1: with 2 attackers, trimmed mean and Multi-Krum then keep one).

    Example:
        >>> with_f("allreduce,robust:aggregator=krum,robust:f=1", 2)
        'allreduce,robust:aggregator=krum:f=2,robust:f=1'
    """
    out = []
    for name in algorithms.split(","):
        fields = name.split(":")
        if fields[0] == "robust" and not any(x.startswith("f=") for x in fields[1:]):
            name += f":f={max(1, f)}"
        out.append(name)
    return ",".join(out)


def _train_args(opts: argparse.Namespace, attack: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    argv = ["--loopback", "--hosts", str(opts.hosts), "--dataset", opts.dataset,
            "--params", str(opts.params), "--epochs", str(opts.epochs),
            "--evals-per-epoch", str(opts.evals_per_epoch),
            "--algorithms", with_f(opts.algorithms, opts.byzantine),
            "--time-limit", str(opts.time_limit), "--partition", opts.partition,
            "--alpha", str(opts.alpha), "--lr", str(opts.lr), "--seed", str(opts.seed),
            "--byzantine", "0" if attack == "none" else str(opts.byzantine),
            "--attack", "sign_flip" if attack == "none" else attack]
    return parser.parse_args(argv)


def _row(attack: str, r: dict[str, Any]) -> dict[str, Any]:
    ranks = {"ranks": r["ranks"]} if "ranks" in r else {}  # every rank's exit and error
    if "error" in r:
        return {"attack": attack, "algorithm": r["algorithm"], "error": r["error"], **ranks}
    steps = max(1, r["curve"][-1]["step"])
    return {"attack": attack, "algorithm": r["algorithm"], "final": r["final"],
            "curve": r["curve"], "step_ms": 1000 * r["time_s"] / steps,
            "mb_per_step": r["bytes_per_step"] / 1e6, **ranks}


def failure_cell(row: dict[str, Any]) -> str:
    """A failed run's table cell from every rank's outcome: the error class and step when
    every rank agrees, else each rank's.

    Example:
        >>> failure_cell({"error": "x", "ranks": [
        ...     {"rank": r, "exit": 3, "error_class": "E", "step": 0} for r in range(2)]})
        'E, step 0, every rank (exit 3)'
    """
    ranks = row.get("ranks")
    if not ranks:
        return "failed"
    what = [(r.get("error_class", r.get("error", "no error")), r.get("step"), r.get("exit"))
            for r in ranks]
    if len(set(what)) == 1:
        cls, step, code = what[0]
        return f"{cls}, step {step}, every rank (exit {code})"
    return "; ".join(f"rank {r['rank']}: {c}, step {s} (exit {e})"
                     for r, (c, s, e) in zip(ranks, what))


def run(opts: argparse.Namespace) -> dict[str, Any]:
    """Every attack in turn; partial results are written after each one."""
    out: dict[str, Any] = {"settings": vars(opts), "rows": []}
    for attack in opts.attacks.split(","):
        print(f"== attack {attack}", file=sys.stderr, flush=True)
        report = robust_run.run_train(_train_args(opts, attack))
        out["machine"] = report["machine"]
        out["rows"] += [_row(attack, r) for r in report["results"]]
        with open(opts.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def merge_rows(rows: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
    """``rows`` with those of the run saved at ``path`` replacing the same cells."""
    with open(path) as f:
        new = {(r["attack"], r["algorithm"]): r for r in json.load(f)["rows"]}
    merged = [new.pop((r["attack"], r["algorithm"]), r) for r in rows]
    return merged + list(new.values())


def markdown(out: dict[str, Any]) -> str:
    """Accuracy table (rows: algorithms, columns: attacks) and a cost table."""
    rows = out["rows"]
    attacks = list(dict.fromkeys(r["attack"] for r in rows))
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    cell = {(r["attack"], r["algorithm"]): r for r in rows}
    lines = ["| algorithm | " + " | ".join(attacks) + " |", "|---" * (len(attacks) + 1) + "|"]
    for a in algos:
        vals = [cell.get((t, a)) for t in attacks]
        lines.append(f"| {a} | " + " | ".join(
            "-" if v is None else (failure_cell(v) if "error" in v else f"{100 * v['final']:.1f}")
            for v in vals) + " |")
    lines += ["", f"| algorithm | step (ms, {attacks[0]}) | MB sent/step/rank |", "|---|---|---|"]
    for a in algos:
        v = cell.get((attacks[0], a))
        if v and "error" not in v:
            lines.append(f"| {a} | {v['step_ms']:.1f} | {v['mb_per_step']:.3f} |")
    return "\n".join(lines)


def plot_worst(out: dict[str, Any], path: str) -> str:
    """Accuracy curves under the attack with the lowest mean final accuracy; its name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in out["rows"] if "error" not in r and r["attack"] != "none"]
    by_attack: dict[str, list[float]] = {}
    for r in rows:
        by_attack.setdefault(r["attack"], []).append(r["final"])
    worst = min(by_attack, key=lambda a: sum(by_attack[a]) / len(by_attack[a]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r["attack"] == worst:
            ax.plot([p["epoch"] for p in r["curve"]], [p["metric"] for p in r["curve"]],
                    marker=".", label=r["algorithm"])
    for r in out["rows"]:  # the reference the targets read against, dashed
        if r["attack"] == "none" and r["algorithm"] == "allreduce" and "error" not in r:
            ax.plot([p["epoch"] for p in r["curve"]], [p["metric"] for p in r["curve"]],
                    "k--", label="allreduce, no attack")
    ax.set_xlabel("epochs")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"Fashion-MNIST, {out['settings']['partition']}, attack {worst}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--hosts", type=int, default=5)
    a("--dataset", default="fashion-mnist", help="digits is the fast one")
    a("--byzantine", type=int, default=1)
    a("--partition", choices=("iid", "dirichlet"), default="iid")
    a("--alpha", type=float, default=0.3)
    a("--attacks", default="none,sign_flip,scale,gaussian,alie,ipm,label_flip,nan")
    a("--algorithms", default=ROBUST_ALGOS)
    a("--epochs", type=int, default=3)
    a("--evals-per-epoch", type=int, default=2)
    a("--params", type=int, default=100_000)
    a("--lr", type=float, default=0.05)
    a("--seed", type=int, default=0, help="initialization, data order, non-IID split")
    a("--time-limit", type=float, default=600.0)
    a("--json", required=True)
    a("--markdown")
    a("--plot")
    a("--report-only", action="store_true", help="re-render --json without training")
    a("--merge", action="append", default=[], metavar="JSON",
      help="with --report-only: rows of this earlier run replace the same attack x algorithm")
    opts = p.parse_args(argv)
    if opts.report_only:
        with open(opts.json) as f:
            out = json.load(f)
        for path in opts.merge:
            out["rows"] = merge_rows(out["rows"], path)
    else:
        out = run(opts)
    text = markdown(out)
    if opts.plot:
        text += f"\n\nplot: {opts.plot} (worst attack: {plot_worst(out, opts.plot)})"
    print(text)
    if opts.markdown:
        with open(opts.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
