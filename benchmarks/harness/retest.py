"""Test-retest of lab runs: what order of step times this machine can resolve at all.

Two lab runs of the same cells (``benchmarks/cost_validation.py`` reports: each setting's
workloads, each workload's cells with ``algorithm`` and ``measured_s``) are compared per
setting and workload: the Spearman rank correlation of measured against measured
(:func:`spearman`), and the median of ``|b / a - 1|`` over the cells both ran (the
run-to-run spread). Where algorithms differ by less than that spread, no model can be
expected to order them better than a rerun does.

:func:`tied_spearman` is an extra view, not the issue's target: the Spearman of predicted
against measured when measured times within ``spread`` (relative) of each other count as
ties (:func:`tie_groups`).

Example:
    >>> a = {"settings": [{"bandwidth": "1gbit", "models": {"mlp": {"cells": [
    ...     {"algorithm": "x", "measured_s": 1.0}, {"algorithm": "y", "measured_s": 2.0},
    ...     {"algorithm": "z", "measured_s": 3.0}]}}}]}
    >>> row = compare(a, a)[0]
    >>> row["setting"], row["workload"], row["retest_spearman"], row["median_abs_diff"]
    ('1gbit', 'mlp', 1.0, 0.0)
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["compare", "markdown", "spearman", "tie_groups", "tied_spearman"]


def _ranks(v: Sequence[float], groups: Sequence[int] | None = None) -> list[float]:
    """Average ranks of ``v`` (0-based); equal values, or equal ``groups`` labels, tie."""
    keys = list(v) if groups is None else list(groups)
    order = sorted(range(len(v)), key=lambda i: (keys[i], v[i]))
    out = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and keys[order[j + 1]] == keys[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def _pearson(rx: Sequence[float], ry: Sequence[float]) -> float:
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 1.0


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties; 1.0 when a side is constant).

    >>> spearman([1, 2, 3, 4], [10, 30, 20, 40])
    0.8
    """
    return _pearson(_ranks(xs), _ranks(ys))


def tie_groups(values: Sequence[float], spread: float) -> list[int]:
    """A group label per value: sorted ascending, a value joins the current group while it
    is within ``spread`` (relative) of the group's smallest, else starts the next group.

    >>> tie_groups([1.00, 1.04, 1.20, 1.03, 1.30], 0.05)
    [0, 0, 1, 0, 2]
    """
    if spread < 0:
        raise ValueError(f"tie_groups: spread must be >= 0, got {spread!r}")
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0] * len(values)
    group, low = -1, None
    for i in order:
        if low is None or values[i] > low * (1.0 + spread):
            group, low = group + 1, values[i]
        out[i] = group
    return out


def tied_spearman(predicted: Sequence[float], measured: Sequence[float], spread: float
                  ) -> float:
    """Spearman of ``predicted`` against ``measured`` with measured times within
    ``spread`` of each other ranked as ties (:func:`tie_groups`): an order the rerun
    cannot resolve costs nothing. An extra view, not the target.

    >>> tied_spearman([1, 2, 3], [1.00, 0.99, 2.0], 0.05)  # 1 and 2 tie when measured
    0.866
    """
    return round(_pearson(_ranks(predicted), _ranks(measured, tie_groups(measured, spread))),
                 3)


def _cells(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """``{(setting, workload): {algorithm: cell}}`` of the cells that ran."""
    out: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for setting in report["settings"]:
        for model, res in setting["models"].items():
            ok = {c["algorithm"]: c for c in res.get("cells", [])
                  if c.get("error") is None and c.get("measured_s")}
            if ok:
                out[(setting["bandwidth"], model)] = ok
    return out


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Per setting and workload both reports ran (``a``'s order): the cells in both with
    the same ``config`` (where cells carry one: a registry default that changed between
    the runs makes another cell; listed in ``other_config``),
    measured-vs-measured Spearman, median ``|b / a - 1|``, and for each run the model's
    Spearman (where the cells hold ``predicted_s``); for ``b`` also :func:`tied_spearman`
    at that spread.

    Raises:
        ValueError: no setting and workload in common.
    """
    ca, cb = _cells(a), _cells(b)
    rows = []
    for key in (k for k in ca if k in cb):
        both = [n for n in ca[key] if n in cb[key]]
        names = [n for n in both if ca[key][n].get("config") == cb[key][n].get("config")]
        if len(names) < 2:
            continue
        ma = [ca[key][n]["measured_s"] for n in names]
        mb = [cb[key][n]["measured_s"] for n in names]
        spread = statistics.median(abs(y / x - 1.0) for x, y in zip(ma, mb))
        row: dict[str, Any] = {"setting": key[0], "workload": key[1], "cells": len(names),
                               "other_config": [n for n in both if n not in names],
                               "retest_spearman": round(spearman(ma, mb), 3),
                               "median_abs_diff": round(spread, 4)}
        for tag, cells, measured in (("a", ca[key], ma), ("b", cb[key], mb)):
            if all("predicted_s" in cells[n] for n in names):
                pred = [cells[n]["predicted_s"] for n in names]
                row[f"model_spearman_{tag}"] = round(spearman(pred, measured), 3)
                if tag == "b":
                    row["model_spearman_b_tied"] = tied_spearman(pred, measured, spread)
        rows.append(row)
    if not rows:
        raise ValueError("compare: the two reports share no setting and workload with 2 or "
                         "more cells; pass two validation.json files of the same cells")
    return rows


def markdown(rows: Sequence[dict[str, Any]], label_a: str, label_b: str) -> str:
    """The table of :func:`compare`'s rows."""
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}"
    lines = [f"| setting | workload | cells | Spearman measured {label_a} vs {label_b} "
             f"| median abs diff | model Spearman {label_a} | model Spearman {label_b} "
             f"| {label_b}, ties within the spread (extra view) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['workload']} | {r['cells']} | "
                     f"{f(r['retest_spearman'])} | {100 * r['median_abs_diff']:.1f} % | "
                     f"{f(r.get('model_spearman_a'))} | {f(r.get('model_spearman_b'))} | "
                     f"{f(r.get('model_spearman_b_tied'))} |")
    return "\n".join(lines)
