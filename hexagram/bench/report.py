"""Figures of a step-time benchmark: summary per algorithm, Markdown table, plot.

Definitions (per algorithm, on one network):
    step time      timed window / timed steps, the slowest rank (a mean, so that delayed
                   algorithms pay for their periodic rounds); next to it the median and
                   p10..p90 of single steps (slowest rank per step): a delayed algorithm's
                   mean can lie above its p90 (most steps are local, a few carry a round)
    samples/s      global batch / step time
    vs ddp         ddp's step time / this step time (> 1: faster than PyTorch DDP)
    wire bytes     per step, the busiest rank (reported by the algorithm; ``~``: formula)
                   and the busiest host's link (interface counter, headers included)
    bound          max(compute time, link bytes / link rate); efficiency = bound / measured
    ready bound    what a synchronous step could reach given when backward produces each
                   gradient (:func:`ready_bound`; the plain bound for model averaging);
                   ready efficiency = ready bound / measured. The gap between the two
                   bounds is the part of the wire time that no implementation can overlap.
    CPU/step       process CPU seconds per step (all threads), the busiest rank, with its
                   kernel part (sockets, and the shaped links' softirqs that ran while it
                   did), and in brackets the same for the local step without
                   communication: what the algorithm adds to the CPU's work (on shared
                   cores it lengthens the step)

Example:
    >>> s = summarize({"step_times": [1.0], "window_s": 1.0, "compute_s": 0.5,
    ...                "reported_bytes": 100, "link_tx_bytes": 125, "steps": 1,
    ...                "estimated": False, "local_rank": 0,
    ...                "rank": 0, "num_params": 10, "finite": True}, rate=1000.0, batch=4,
    ...               world=1)
    >>> s["bound_s"], s["efficiency"]
    (1.0, 1.0)
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any

from hexagram.bench.harness import Outcome
from hexagram.errors import require

__all__ = ["markdown_table", "plot_throughput", "summarize", "summarize_outcome",
           "write_outputs"]


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(*ranks: dict[str, Any], rate: float | None, batch: int,
              world: int) -> dict[str, Any]:
    """Summary figures from the rank results of one algorithm (see module docstring)."""
    per_step = [max(step) for step in zip(*(r["step_times"] for r in ranks))]
    steps = ranks[0]["steps"]
    mean = max(r["window_s"] for r in ranks) / steps
    compute = max(r["compute_s"] for r in ranks)
    reported = max(r["reported_bytes"] for r in ranks) / steps
    links = [r["link_tx_bytes"] for r in ranks
             if r.get("local_rank", 0) == 0 and r.get("link_tx_bytes") is not None]
    link = max(links) / steps if links else None
    wire = link if link is not None else reported
    wire_s = wire * 8 / rate if rate else 0.0
    bound = max(compute, wire_s)
    ready = max(ready_bound(r, wire_s) for r in ranks)
    return {"step_s": mean, "median_s": statistics.median(per_step),
            "p10_s": _percentile(per_step, 0.1), "p90_s": _percentile(per_step, 0.9),
            "steps": steps,
            "samples_per_s": batch * world / mean, "compute_s": compute,
            "reported_bytes_per_step": reported, "estimated": ranks[0]["estimated"],
            "link_bytes_per_step": link, "bound_s": bound, "efficiency": bound / mean,
            "ready_bound_s": ready, "ready_efficiency": ready / mean,
            "num_params": ranks[0]["num_params"], "finite": all(r["finite"] for r in ranks),
            **_cpu(ranks)}


def ready_bound(rank: dict[str, Any], wire_s: float) -> float:
    """Shortest synchronous step for ``rank``'s local step and ``wire_s`` of link time.

    Each parameter's share of the wire time (by size) is sent no earlier than its gradient
    is ready in the local step, one after the other in ready order, at the full link rate;
    the update (the local step after backward returned) follows the last one. So the
    result is the longer of the local step and *last arrival + update*. Results of weight
    algorithms (``in_backward`` False: they average models after the step, which async and
    streaming rounds overlap with later steps) and of older workers get the plain bound
    max(compute, wire).

    Example:
        >>> r = {"compute_s": 1.0, "backward_s": 0.8, "ready_s": [0.3, 0.8],
        ...      "ready_numel": [1, 1]}
        >>> round(ready_bound(r, wire_s=1.0), 3)  # 0.3 + 0.5, then 0.8 + 0.5, + 0.2 update
        1.5
    """
    compute, ready = rank["compute_s"], rank.get("ready_s")
    if not ready or not rank.get("in_backward", True):
        return max(compute, wire_s)
    total = sum(rank["ready_numel"]) or 1
    link_free = 0.0
    for t, n in sorted(zip(ready, rank["ready_numel"])):
        link_free = max(link_free, t) + wire_s * n / total
    return max(compute, link_free + compute - rank["backward_s"])


def _cpu(ranks: Sequence[dict[str, Any]]) -> dict[str, float]:
    if not all("cpu_s" in r for r in ranks):  # results of an older worker
        return {}
    busiest = max(ranks, key=lambda r: r["cpu_s"])
    return {"cpu_s": busiest["cpu_s"], "cpu_sys_s": busiest.get("cpu_sys_s"),
            "compute_cpu_s": max(r["compute_cpu_s"] for r in ranks)}


def summarize_outcome(outcome: Outcome, rate: float | None, batch: int,
                      world: int) -> dict[str, Any]:
    """:func:`summarize`, or the error of a failed algorithm."""
    if not outcome.ok:
        return {"algorithm": outcome.algorithm, "error": outcome.error}
    decision = outcome.ranks[0].get("decision") if outcome.ranks else None
    chose = {"chose": decision["label"], "tuned": decision.get("tuned")} if decision else {}
    return {"algorithm": outcome.algorithm, **chose,
            **summarize(*outcome.ranks, rate=rate, batch=batch, world=world)}


def _mb(nbytes: float | None, estimated: bool = False) -> str:
    if nbytes is None:
        return "-"
    return f"{'~' if estimated else ''}{nbytes / 1e6:.2f}"


def markdown_table(rows: Sequence[dict[str, Any]], reference: str = "ddp") -> str:
    """A Markdown table of summaries (one network); ratios against ``reference``."""
    ref = next((r for r in rows if r["algorithm"] == reference and "error" not in r), None)
    head = ("| algorithm | step time (s), mean | single steps, median [p10-p90] | samples/s | "
            "vs ddp | MB/step reported | MB/step on link | bound (s) | efficiency | "
            "ready bound (s) | ready efficiency | CPU/step, s (local step) |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['algorithm']} | failed: {r['error']} |" + " |" * 10)
            continue
        ratio = f"{ref['step_s'] / r['step_s']:.2f}x" if ref else "-"
        name = f"{r['algorithm']} (ran {r['chose']})" if r.get("chose") else r["algorithm"]
        lines.append(
            f"| {name} | {r['step_s']:.3f} | {r['median_s']:.3f} "
            f"[{r['p10_s']:.3f}-{r['p90_s']:.3f}] | "
            f"{r['samples_per_s']:.1f} | {ratio} | "
            f"{_mb(r['reported_bytes_per_step'], r['estimated'])} | "
            f"{_mb(r['link_bytes_per_step'])} | {r['bound_s']:.3f} | "
            f"{100 * r['efficiency']:.0f}% | {_ready_text(r)} | {_cpu_text(r)} |")
    return "\n".join(lines)


def _ready_text(row: dict[str, Any]) -> str:
    if "ready_bound_s" not in row:  # a report written before the ready bound existed
        return "- | -"
    return f"{row['ready_bound_s']:.3f} | {100 * row['ready_efficiency']:.0f}%"


def _cpu_text(row: dict[str, Any]) -> str:
    if "cpu_s" not in row:
        return "-"
    kernel = "" if row.get("cpu_sys_s") is None else f", kernel {row['cpu_sys_s']:.3f}"
    return f"{row['cpu_s']:.3f}{kernel} ({row['compute_cpu_s']:.3f})"


def plot_throughput(results: dict[str, list[dict[str, Any]]], path: str,
                    title: str = "") -> None:
    """Samples/s against bandwidth, one line per algorithm (bars for a single bandwidth).

    ``results`` maps a bandwidth label (``"100mbit"``, ``"unshaped"``) to its summaries.
    """
    matplotlib = require("matplotlib", extra="bench", feature="plotting")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    algorithms = list(dict.fromkeys(r["algorithm"] for rows in results.values() for r in rows))
    fig, ax = plt.subplots(figsize=(8, 5))
    for algo in algorithms:
        ys = [next((r["samples_per_s"] for r in results[b]
                    if r["algorithm"] == algo and "error" not in r), float("nan"))
              for b in labels]
        if len(labels) == 1:
            ax.bar(algo, ys[0])
        else:
            style = "--" if algo.startswith("ddp") else "-"
            ax.plot(range(len(labels)), ys, style, marker="o", label=algo)
    if len(labels) > 1:
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("link bandwidth per host")
        ax.legend(fontsize=7, ncol=2)
        ax.set_yscale("log")
    else:
        ax.tick_params(axis="x", rotation=45)
        ax.set_xlabel(f"algorithm ({labels[0]} links)")
    ax.set_ylabel("samples/s (higher is better)")
    ax.set_title(title or "Throughput against bandwidth")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: dict[str, Any], text: str, json_path: str | None,
                  markdown_path: str | None) -> None:
    """Write ``report`` as JSON (replacing the file) and append ``text`` to a markdown file;
    either path may be None."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    if markdown_path:
        with open(markdown_path, "a") as f:
            f.write(text + "\n")
