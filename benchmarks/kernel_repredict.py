"""Stored lab runs re-predicted by the code this script runs from, per cell, for a
before/after comparison of a change to the pricing kernel (nothing is measured again).

- ``--planner``: the planner's calibration runs (``plan_calibration.py --json`` files):
  each stored plan priced again under the cluster it was planned on
  (:func:`hexagram.parallel.reprice.price`), and with ``--hosts`` under the same
  calibration laid out as hosts with two measured links;
- ``--auto``: ``auto``'s validation runs (``cost_validation.py --out`` folders): each cell
  predicted again from its recorded compute and the run's probe. The compressors' costs
  (and QAdam's optimizer work) are timed once and kept in ``--costs`` (read back when it
  exists), so two trees predict with the same ones and only the model differs;
- ``--simulate``: ``hexagram simulate`` against the lab (the recorded fixture).

Run in each tree (a ``git archive`` of the commit before, and this one), then compare:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kernel_repredict.py --out after.json \\
        --planner benchmarks/results/plan_calibration_run_ar.json \\
        --hosts 2,1001,7.368,1122,0.094 \\
        --auto benchmarks/results/auto/cvf --costs /tmp/costs.json \\
        --simulate tests/data/simulate_lab_recorded.json
    .venv/bin/python benchmarks/kernel_repredict.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from hexagram.cost.profile import CompressorCost, TreeCost


def planner_cells(paths: list[str], hosts: str | None) -> dict[str, float]:
    """``file/ranks/plan`` -> predicted ms: each stored plan priced again under the
    cluster it was planned on; with ``hosts`` (``PER_HOST,INTRA_US,INTRA_GBPS,INTER_US,
    INTER_GBPS``) also under the same calibration laid out as hosts of ``PER_HOST`` ranks
    with those two links (:func:`hexagram.parallel.host_links.on_hosts`)."""
    from plan_calibration import _graph

    from hexagram.parallel.host_links import KEYS, on_hosts
    from hexagram.parallel.plans import Plan
    from hexagram.parallel.reprice import price

    out = {}
    for path in paths:
        for world in json.loads(Path(path).read_text())["worlds"]:
            for row in world["plans"]:
                if "plan" not in row:
                    continue
                plan = Plan.from_json(row["plan"])
                cell = f"{Path(path).name}/{world['ranks']}/{row['name']}"
                out[cell] = price(_graph(), plan) * 1e3
                if hosts and plan.cluster.devices > 2:
                    per_host, *links = hosts.split(",")
                    cluster = on_hosts(plan.cluster, dict(zip(KEYS, map(float, links))),
                                       int(per_host))
                    out[f"{cell} on {cluster.hosts}x{per_host}"] = price(
                        _graph(), plan, cluster) * 1e3
    return out


def _cost(d: dict[str, Any]) -> CompressorCost:
    tree = None if d["tree"] is None else TreeCost(tuple(d["tree"]["once"]),
                                                   tuple(d["tree"]["per_round"]))
    return CompressorCost(tuple(d["compress"]), tuple(d["decompress"]), tree)  # type: ignore[arg-type]


def auto_cells(folders: list[str], costs_path: str) -> dict[str, float]:
    """``folder/bandwidth/model/algorithm`` -> predicted ms (cost_validation's repredict,
    with compressor costs fixed in ``costs_path``)."""
    from cost_validation import measured_config, model_costs

    from hexagram.algorithms import registry
    from hexagram.bench.task import load_probe
    from hexagram.cost.model import predict
    from hexagram.cost.own_work import job_compute, optimizer_extra_s
    from hexagram.cost.profile import ComputeProfile

    stored = json.loads(Path(costs_path).read_text()) if Path(costs_path).exists() else {}
    out = {}
    for folder in folders:
        report = json.loads((Path(folder) / "validation.json").read_text())
        started = report.get("started", "")
        for setting in report["settings"]:
            bw = setting["bandwidth"]
            network, _ = load_probe(Path(folder) / f"probe-{bw}" / "probe.json")
            for model, res in setting["models"].items():
                cells = [c for c in res["cells"] if c.get("error") is None and "compute" in c]
                if not cells:
                    continue
                key = f"{Path(folder).name}/{bw}/{model}"
                profiles = [ComputeProfile.from_json(c["compute"]) for c in cells]
                configs = {c["algorithm"]: measured_config(c["algorithm"], started)
                           for c in cells}
                if key not in stored:
                    stored[key] = {k: asdict(v) for k, v in model_costs(
                        list(configs), profiles[0], network.world, configs, 3).items()}
                costs = {k: _cost(v) for k, v in stored[key].items()}
                shapes = [t.shape for t in profiles[0].tensors]
                if "qadam" in configs and f"{key}/qadam extra" not in stored:
                    stored[f"{key}/qadam extra"] = optimizer_extra_s(shapes)  # timed: kept
                extra = stored.get(f"{key}/qadam extra", 0.0)
                for c, own in zip(cells, profiles):
                    name = c["algorithm"]
                    algorithm = registry.get(name, **configs[name])
                    pred = predict(algorithm, job_compute(name, own, extra), network,
                                   costs.get(name))
                    out[f"{key}/{name}"] = pred.step_s * 1e3
    Path(costs_path).write_text(json.dumps(stored))
    return out


def simulate_cells(fixture: str) -> dict[str, float]:
    """``hosts x ranks/bandwidth/model/label`` -> predicted ms."""
    from harness.simulate_lab import LabRecord, predict_record

    out = {}
    for raw in json.loads(Path(fixture).read_text()):
        rec = LabRecord(**raw)
        row = predict_record(rec)
        if row.step_s is not None:
            out[f"{rec.hosts}x{rec.ranks_per_host}/{rec.bandwidth}/{rec.model}/"
                f"{rec.label}"] = row.step_s * 1e3
    return out


def compare(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> str:
    """A Markdown table per part: every cell, before and after (ms), and the ratio."""
    lines = []
    for part in after:
        lines += [f"\n#### {part}\n", "| cell | before ms | after ms | after / before |",
                  "|---|---|---|---|"]
        for cell, new in after[part].items():
            old = before.get(part, {}).get(cell)
            ratio = f"{new / old:.4f}" if old else "-"
            lines.append(f"| {cell} | {old if old is None else f'{old:.3f}'} | {new:.3f} | "
                         f"{ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planner", nargs="*", default=[])
    ap.add_argument("--hosts", default=None,
                    help="PER_HOST,INTRA_US,INTRA_GBPS,INTER_US,INTER_GBPS (see planner_cells)")
    ap.add_argument("--auto", nargs="*", default=[])
    ap.add_argument("--costs", default="/tmp/kernel_repredict_costs.json")
    ap.add_argument("--simulate", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        print(compare(before, after))
        return
    torch.set_num_threads(1)
    out: dict[str, dict[str, float]] = {}
    if args.planner:
        out["planner calibration"] = planner_cells(args.planner, args.hosts)
    if args.auto:
        out["auto validation"] = auto_cells(args.auto, args.costs)
    if args.simulate:
        out["simulate against the lab"] = simulate_cells(args.simulate)
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
