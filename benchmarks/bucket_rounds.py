"""The bucket-size study of docs/benchmarks/auto.md, in interleaved rounds (``cost_validation.py
--only-buckets``): fixed bucket sizes and ``auto`` restricted to the same algorithm.

Every round runs each configuration once (1, 4, 25, 100 MB fixed, then auto), the order
rotated by one position per round, so a slow minute of a shared machine lands on different
configurations; all rounds run in one launch of the ranks. Reported per configuration: the
median over rounds of its mean step time and the spread (min-max over rounds); for auto,
``auto / best fixed`` (auto's median over the best fixed size's median) and the same ratio
within each round (auto's cell over that round's fastest fixed cell), min-max. Each size's
bucket layout is listed: sizes with the same layout run the same code, so their difference
is the noise floor of the study.

``--bucket-rounds 1 --bucket-steps 6`` is the earlier single-run study. Sizes with the
same layout are also pooled (:func:`by_layout`): per round the mean of their cells, and
each layout's ratio to the fastest one within every round (paired, so a slow round does
not count as a difference). ``python benchmarks/bucket_rounds.py OUT/validation.json``
prints the tables of a saved run again.

Example (pure helpers, no lab):
    >>> rotate(["a", "b", "c"], 1)
    ['b', 'c', 'a']
    >>> s = summarize_rounds({"1": [1.0, 1.2, 1.1], "auto": [1.05, 1.1, 1.3]}, ["1"])
    >>> round(s["ratio"], 3), [round(x, 3) for x in s["ratio_spread"]]
    (1.0, [0.917, 1.182])
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hexagram.bench.report import summarize_outcome
from hexagram.buckets import build_buckets
from hexagram.models.workload import ModelSpec, build_workload

__all__ = ["SIZES", "by_layout", "layouts", "markdown", "rotate", "run_rounds", "summarize_rounds",
           "where_ranks_import"]

#: the bucket sizes auto chooses among (MB)
SIZES = (1.0, 4.0, 25.0, 100.0)
#: auto held to one bucket size (no trials): what auto itself costs, apart from its pick
AUTO_HELD = "auto@25"
MB = 1 << 20


def rotate(keys: Sequence[str], round_: int) -> list[str]:
    """``keys`` started at position ``round_`` (mod their number)."""
    k = round_ % len(keys)
    return [*keys[k:], *keys[:k]]


def layouts(model: dict[str, Any], sizes: Sequence[float] = SIZES) -> dict[str, list[int]]:
    """Per size, the engine's buckets over ``model`` (launch order, first bucket capped at
    1 MB as the engine does): the number of parameters in each bucket."""
    work = build_workload(ModelSpec(**model))
    named = list(reversed(list(work.model.named_parameters())))
    return {f"{mb:g}": [len(b.names) for b in build_buckets(named, int(mb * MB),
                                                            min(MB, int(mb * MB)))]
            for mb in sizes}


def where_ranks_import(lab: Any) -> list[str]:
    """The ``hexagram`` package each rank of ``lab`` imports (PYTHONPATH must reach them)."""
    code = "import hexagram, os; print('HEXAGRAM_AT', os.path.dirname(hexagram.__file__))"
    ranks = lab.run([sys.executable, "-c", code], timeout=120)
    return [line.split(" ", 1)[1] for r in ranks for line in r.output.splitlines()
            if line.startswith("HEXAGRAM_AT ")]


def summarize_rounds(cells: dict[str, list[float]], fixed: Sequence[str]
                     ) -> dict[str, Any]:
    """Medians and spreads over rounds; ``cells[key][r]`` is round ``r``'s mean step time
    (None: that cell failed) and ``fixed`` the keys of the fixed sizes (``"auto"`` is
    compared with them)."""
    ok = {k: [t for t in v if t is not None] for k, v in cells.items()}
    med = {k: statistics.median(v) for k, v in ok.items() if v}
    out: dict[str, Any] = {"median": med,
                           "spread": {k: [min(v), max(v)] for k, v in ok.items() if v}}
    best = min((k for k in fixed if k in med), key=lambda k: med[k], default=None)
    out["best_fixed"] = best
    if best is not None and "auto" in med:
        out["ratio"] = med["auto"] / med[best]
        per_round = [a / min(cells[k][r] for k in fixed)
                     for r, a in enumerate(cells["auto"])
                     if a is not None and all(cells[k][r] is not None for k in fixed)]
        out["ratio_rounds"] = per_round
        out["ratio_spread"] = [min(per_round), max(per_round)] if per_round else None
    return out


def by_layout(row: dict[str, Any], layout: dict[str, list[int]]) -> list[dict[str, Any]]:
    """The fixed sizes of ``row`` (one algorithm's study) pooled by bucket layout: per
    layout its sizes, the median over rounds of the round's mean over its sizes, and per
    round its ratio to the fastest layout of that round (median, min-max); last, auto's
    cells against the same (the fairer ``auto / best``: the fastest of four noisy cells
    of two configurations is lower than the better configuration)."""
    groups: dict[str, list[str]] = {}
    for k in (f"{mb:g}" for mb in SIZES):
        groups.setdefault(str(layout[k]), []).append(k)
    cells = {k: [c.get("step_s") for c in row["runs"][k]] for k in row["runs"]}
    rounds = range(len(cells["auto"]))
    mean = {g: [statistics.fmean(cells[k][r] for k in ks)
                if all(cells[k][r] is not None for k in ks) else None for r in rounds]
            for g, ks in groups.items()}
    autos = [k for k in ("auto", AUTO_HELD) if k in cells]
    mean.update({k: cells[k] for k in autos})
    out = []
    for g, ks in [*groups.items(), *((k, [k]) for k in autos)]:
        ratio = [mean[g][r] / min(m[r] for k, m in mean.items() if k not in autos)
                 for r in rounds if all(m[r] is not None for m in mean.values())]
        out.append({"layout": g, "sizes": ks,
                    "median_s": statistics.median(t for t in mean[g] if t is not None),
                    "ratio": statistics.median(ratio) if ratio else None,
                    "ratio_spread": [min(ratio), max(ratio)] if ratio else None})
    return out


def _cell(outcome: Any, cfg: Any, batch: int) -> dict[str, Any]:
    row = summarize_outcome(outcome, cfg.rate, batch, cfg.world_size)
    if "error" in row:
        return {"error": row["error"]}
    decision = (outcome.ranks[0].get("decision") or {}) if outcome.ranks else {}
    ranks = outcome.ranks
    return {"step_s": row["step_s"], "median_s": row["median_s"], "steps": row["steps"],
            "chose_mb": (decision.get("bucket_bytes") or 0) / MB or None,
            "tuned": decision.get("tuned"),
            # per step, the slowest rank's: the untimed steps (auto's exploring ones), then
            # the timed ones
            "warmup_s": [max(s) for s in zip(*(r.get("warmup_times", []) for r in ranks))],
            "steps_s": [max(s) for s in zip(*(r["step_times"] for r in ranks))]}


def run_rounds(lab: Any, cfg: Any, spec: Callable[[str, float | None], dict[str, Any]],
               run_series: Callable[..., list[Any]], label: str, rounds: int,
               timeout: float, batch: int) -> dict[str, Any]:
    """One algorithm's study: ``rounds`` rounds of the fixed sizes and auto (``spec(key,
    mb)`` builds each run's spec: ``key`` is a size, ``"auto"`` or :data:`AUTO_HELD`, auto
    held to 25 MB), in one series."""
    keys = [f"{mb:g}" for mb in SIZES] + ["auto", AUTO_HELD]
    order = [rotate(keys, r) for r in range(rounds)]
    specs = [spec(k, 25.0 if k == AUTO_HELD else None if k == "auto" else float(k))
             for row in order for k in row]
    outcomes = run_series(lab, specs, timeout=timeout)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
    for k, o in zip((k for row in order for k in row), outcomes):
        runs[k].append(_cell(o, cfg, batch))
    cells = {k: [c.get("step_s") for c in v] for k, v in runs.items()}
    return {"label": label, "rounds": rounds, "order": order, "runs": runs,
            **summarize_rounds(cells, keys[:-2]),
            # the single-run table's columns: the medians over rounds
            **{k: statistics.median(t for t in ts if t is not None)
               if any(t is not None for t in ts) else None for k, ts in cells.items()}}


def _rows(study: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(k, v) for k, v in study.items() if isinstance(v, dict) and "runs" in v]


def markdown(study: dict[str, Any], setting: str = "") -> str:
    """The old single-run columns (medians over rounds), then per configuration the
    median, spread and auto's choices, with the layouts."""
    keys = [f"{mb:g}" for mb in SIZES]
    lines = ["\n| setting | algorithm | 1 MB | 4 MB | 25 MB | 100 MB | auto "
             "| auto / best fixed [per-round min-max] | rounds |", "|---" * 9 + "|"]
    for name, row in _rows(study):
        cells = " | ".join("-" if row.get(k) is None else f"{row[k]:.3f}"
                           for k in (*keys, "auto"))
        ratio = "-"
        if row.get("ratio") is not None:
            lo, hi = row.get("ratio_spread") or (float("nan"), float("nan"))
            ratio = f"{row['ratio']:.2f} [{lo:.2f}-{hi:.2f}]"
        lines.append(f"| {setting} | {name} | {cells} | {ratio} | {row.get('rounds', 1)} |")
    lines += ["", "| setting | algorithm | configuration | median s/step | min-max over rounds "
              "| per round |", "|---" * 6 + "|"]
    for name, row in _rows(study):
        for k in row["runs"]:
            ts = [c.get("step_s") for c in row["runs"][k]]
            lo, hi = row["spread"].get(k, (float("nan"), float("nan")))
            each = ", ".join("failed" if t is None else f"{t:.3f}" for t in ts)
            if k.startswith("auto"):
                each += " (chose " + ", ".join(f"{c.get('chose_mb') or 0:g}"
                                               for c in row["runs"][k]) + " MB)"
            lines.append(f"| {setting} | {name} | {k if k.startswith('auto') else k + ' MB'} | "
                         f"{row['median'].get(k, float('nan')):.3f} | {lo:.3f}-{hi:.3f} "
                         f"| {each} |")
    if study.get("layouts"):
        lines += ["", "| setting | algorithm | layout (parameters per bucket) | sizes "
                  "| median s/step | / fastest layout, per round: median [min-max] |",
                  "|---" * 6 + "|"]
        for name, row in _rows(study):
            for g in by_layout(row, study["layouts"]):
                lo, hi = g["ratio_spread"] or (float("nan"), float("nan"))
                sizes = ", ".join(k if k.startswith("auto") else k + " MB" for k in g["sizes"])
                lines.append(f"| {setting} | {name} | {g['layout']} | {sizes} | "
                             f"{g['median_s']:.3f} | {g['ratio']:.3f} [{lo:.3f}-{hi:.3f}] |")
    if study.get("ranks_import"):
        lines.append(f"\nranks imported hexagram from: {sorted(set(study['ranks_import']))}")
    if study.get("layouts"):
        lines.append("\nbucket layouts (parameters per bucket, launch order): " + "; ".join(
            f"{k} MB: {v}" for k, v in study["layouts"].items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # the tables of a saved run: bucket_rounds.py OUT/validation.json
    import json
    from pathlib import Path

    saved = json.loads(Path(sys.argv[1]).read_text())
    for setting in saved["settings"]:
        for res in setting["models"].values():
            if res.get("buckets"):
                print(markdown(res["buckets"], setting["bandwidth"]))
