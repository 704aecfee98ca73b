"""The Markdown tables of ``benchmarks/cost_validation.py``'s reports (``validation.md``,
``validation-repredicted*.md``): per setting and workload, predicted vs measured step time
and wire bytes with the summary line (median absolute error, worst cell, Spearman), auto's
line against the fastest default candidate and the fastest fixed algorithm, and the bucket
study's tables (:func:`bucket_rounds.markdown`). Pure: reads a report dict, times nothing.

Example:
    >>> cells = [{"algorithm": "a", "predicted_s": 0.1, "measured_s": 0.1, "rel_error": 0.0},
    ...          {"algorithm": "b", "predicted_s": 0.3, "measured_s": 0.2, "rel_error": 0.5}]
    >>> s = summary(cells)
    >>> s["worst"], s["median_abs_error"], s["spearman"]
    ('b', 0.25, 1.0)
"""

from __future__ import annotations

import statistics
from typing import Any

import bucket_rounds  # benchmarks/bucket_rounds.py, beside this script
from harness.retest import spearman

from hexagram.auto import choose

__all__ = ["markdown", "summary"]


def summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Median |relative error|, the worst cell and its error, and the Spearman rank
    correlation of predicted vs measured over the cells that ran ({} when none did)."""
    ok = [c for c in cells if c.get("error") is None]
    if not ok:
        return {}
    errs = [abs(c["rel_error"]) for c in ok]
    worst = max(ok, key=lambda c: abs(c["rel_error"]))
    return {"median_abs_error": statistics.median(errs), "worst": worst["algorithm"],
            "worst_error": worst["rel_error"],
            "spearman": spearman([c["predicted_s"] for c in ok], [c["measured_s"] for c in ok])}


def markdown(report: dict[str, Any]) -> str:
    """Every setting x workload of ``report`` (``validation.json``'s layout): the cells'
    table, auto's line and the bucket study, where the run has them."""
    lines = []
    for setting in report["settings"]:
        for model, res in setting["models"].items():
            if res["cells"]:  # --only-buckets runs no validation cells
                lines += _cell_lines(setting["bandwidth"], model, res["cells"])
            lines.append(_auto_line(res))
            lines.append(_bucket_lines(res.get("buckets"), setting["bandwidth"]))
    return "\n".join(lines)


def _cell_lines(bandwidth: str, model: str, cells: list[dict[str, Any]]) -> list[str]:
    s = summary(cells)
    lines = [f"\n#### {bandwidth}, {model}: median |error| "
             f"{100 * s.get('median_abs_error', float('nan')):.0f} %, worst "
             f"{s.get('worst')} {100 * s.get('worst_error', float('nan')):+.0f} %, "
             f"Spearman {s.get('spearman', float('nan')):.2f}\n",
             "| algorithm | predicted s | measured s | error | wire MB predicted "
             "| wire MB reported | compute / compression / exposed (s) |",
             "|---|---|---|---|---|---|---|"]
    for c in cells:
        if c.get("error"):
            lines.append(f"| {c['algorithm']} | failed: {c['error'][:80]} | | | | | |")
            continue
        parts = " / ".join(f"{x:.3f}" for x in c["parts"])
        lines.append(f"| {c['algorithm']} | {c['predicted_s']:.3f} | "
                     f"{c['measured_s']:.3f} | {100 * c['rel_error']:+.0f} % | "
                     f"{c['wire_predicted'] / 1e6:.2f} | "
                     f"{c['wire_reported'] / 1e6:.2f} | {parts} |")
    return lines


def _auto_line(res: dict[str, Any]) -> str:
    auto = res.get("auto")
    ok = [c for c in res["cells"] if c.get("error") is None]
    if not auto or not ok:
        return ""
    if "error" in auto:
        return f"\nauto: failed: {auto['error'][:200]}\n"
    best = min(ok, key=lambda c: c["measured_s"])
    default = {choose.parse_label(label)[0] for label in choose.DEFAULT}
    cand = min((c for c in ok if c["algorithm"] in default), key=lambda c: c["measured_s"],
               default=best)
    chose = auto.get("decision") or {}
    label = f" (chose {chose['label']}, {chose.get('bucket_bytes', 0) / 2**20:g} MB buckets)" \
        if chose else ""
    return (f"\nauto{label}: {auto['measured_s']:.3f} s/step measured; fastest default "
            f"candidate: {cand['algorithm']} {cand['measured_s']:.3f} s (auto/fastest = "
            f"{auto['measured_s'] / cand['measured_s']:.2f}); fastest of all: "
            f"{best['algorithm']} {best['measured_s']:.3f} s\n")


def _bucket_lines(study: dict[str, Any] | None, setting: str = "") -> str:
    return bucket_rounds.markdown(study, setting) if study else ""
