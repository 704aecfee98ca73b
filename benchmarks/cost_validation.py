"""Validate the step-time model in the network lab, and run ``auto`` next to fixed choices.

For each bandwidth (a fresh lab of ``--hosts`` emulated hosts) the probe job runs first
(``hexagram.bench.task``: network fits, all ranks at once); then, per workload, every
compressor is timed on the workload's own tensor shapes (CPU seconds, as ``auto`` times
them), every synchronous gradient algorithm runs the lab's step benchmark (the worker
records each rank's local compute: when every gradient is ready, backward, update) and
the model predicts its step from those measurements. Reported per setting: predicted vs
measured step time, wire bytes predicted vs reported, median absolute error, worst cell
and Spearman rank correlation; with ``--auto`` also ``auto``'s measured step time against
the fastest default candidate of ``auto`` (the target's comparison) and the fastest fixed
algorithm of the same run.

Usage (root, iproute2; ``--loopback`` runs unshaped on 127.0.0.1 without root):

    .venv/bin/python benchmarks/cost_validation.py --bandwidth 10mbit,100mbit,1gbit,unshaped \\
        --models mlp,gpt,cnn --auto --out /tmp/cost-validation

Output: ``OUT/validation.json`` and ``OUT/validation.md`` (tables as in
docs/benchmarks/auto.md). ``--repredict --out OUT`` (no lab, no root) redoes the predictions
of a saved run with the current model: ``OUT/validation-repredicted.{md,json}``; with
``--compute common`` from one compute profile per workload, as auto predicts
(``OUT/validation-repredicted-common.{md,json}``). ``--compare A.json B.json --out OUT``
(no lab): test-retest of two runs of the same cells, per setting and workload
(:mod:`harness.retest`: measured-vs-measured Spearman, median difference, the
model's Spearman in each and, as an extra view, with ties within that spread):
``OUT/compare.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import bucket_rounds  # benchmarks/bucket_rounds.py, beside this script
import torch
from cost_validation_report import markdown  # beside this script
from harness.retest import compare
from harness.retest import markdown as compare_markdown

from hexagram.algorithms import registry
from hexagram.algorithms.qadam import optimizer_extra_s
from hexagram.bench.harness import LoopbackLab, machine_info, run_series
from hexagram.bench.lab import LabConfig, NetworkLab
from hexagram.bench.report import summarize_outcome
from hexagram.bench.task import load_probe, run_in_lab
from hexagram.cost.measure import local_costs, static_profile
from hexagram.cost.model import predict
from hexagram.cost.own_work import job_compute
from hexagram.cost.probe import NetworkProfile
from hexagram.cost.profile import CompressorCost, ComputeProfile, TreeCost
from hexagram.cost.schedule import TensorSpec
from hexagram.models.workload import ModelSpec, build_workload

#: the bench's settings for the short window: PowerSGD compresses from step 0
CONFIG = {"powersgd": {"start_iter": 0}}
#: registry defaults changed after the stored runs were measured (UTC time of the change,
#: algorithm, the configuration the older runs measured): re-predicting a run started
#: before the change predicts what it measured (wire bytes then equal the reported ones)
MEASURED_AS: list[tuple[str, str, dict[str, Any]]] = [
    ("2026-11-25 23:23:30", "onebit", {"block": 0}),  # c97d869: block-wise scales
    ("2026-11-25 23:23:30", "efsign", {"block": 0}),
    ("2026-11-26 02:21:59", "randomk", {"density": 0.25, "error_feedback": True}),  # 2aaa794
]
MODELS = {"mlp": {"params": 6_300_000, "layers": 3}, "gpt": {"layers": 4, "width": 256},
          "cnn": {"width": 256}}


def sync_algorithms() -> list[str]:
    """Every registered gradient algorithm except auto."""
    return [n for n in registry.names() if n != "auto" and registry.get(n).kind == "grad"]


def _spec(args: argparse.Namespace, model: str, name: str, config: dict[str, Any],
          warmup: int, bucket_mb: float | None = None) -> dict[str, Any]:
    return {"task": "step", "algorithm": name, "label": name, "config": config,
            "model": {"name": model, **MODELS[model]}, "steps": args.steps, "min_steps": 3,
            "warmup": warmup, "time_limit": args.time_limit, "batch": args.batch,
            "lr": 0.01, "seed": 0, "bucket_mb": bucket_mb, "stall_timeout": 90,
            "compute_steps": args.compute_steps}


def bucket_study(args: argparse.Namespace, lab: Any, cfg: LabConfig, model: str
                 ) -> dict[str, Any]:
    """allreduce and powersgd at 1, 4, 25 and 100 MB fixed buckets, and auto restricted to
    the same algorithm (it tunes the bucket size), in ``--bucket-rounds`` interleaved
    rounds of ``--bucket-steps`` timed steps each (benchmarks/bucket_rounds.py)."""
    out: dict[str, Any] = {"layouts": bucket_rounds.layouts({"name": model, **MODELS[model]}),
                           "ranks_import": bucket_rounds.where_ranks_import(lab)}
    for name in args.bucket_algorithms.split(","):
        label = "powersgd:start_iter=0" if name == "powersgd" else name

        def spec(key: str, mb: float | None, name: str = name, label: str = label
                 ) -> dict[str, Any]:
            if key.startswith("auto"):  # 12 untimed steps: profile, decide, time buckets
                held = {"bucket_mb": [mb], "tune_buckets": 1} if mb else {}  # no trials
                return {**_spec(args, model, "auto", {"candidates": [label], "verbose": False,
                                                      **held}, 12),
                        "steps": args.bucket_steps, "label": f"{key} {label}"}
            return {**_spec(args, model, name, CONFIG.get(name, {}), args.warmup, mb),
                    "steps": args.bucket_steps, "label": f"{name} {key} MB"}
        print(f"buckets {model} {name}: {args.bucket_rounds} rounds", file=sys.stderr,
              flush=True)
        out[name] = bucket_rounds.run_rounds(lab, cfg, spec, run_series, label,
                                             args.bucket_rounds, args.timeout, args.batch)
    return out


def _compute(ranks: list[dict[str, Any]], shapes: list[tuple[int, ...]]) -> ComputeProfile:
    """The slowest rank's local step (per-parameter maxima over ranks)."""
    slow = {"compute_s": max(r["compute_s"] for r in ranks),
            "backward_s": max(r["backward_s"] for r in ranks),
            "ready_s": [max(col) for col in zip(*(r["ready_s"] for r in ranks))],
            "ready_numel": ranks[0]["ready_numel"],
            "compute_cpu_s": max(r["compute_cpu_s"] for r in ranks)}
    return ComputeProfile.from_worker(slow, shapes)


def _cell(name: str, outcome: Any, args: argparse.Namespace, lab_cfg: LabConfig,
          shapes: list[tuple[int, ...]], network: NetworkProfile,
          costs: dict[str, CompressorCost], extra_s: float) -> dict[str, Any]:
    row = summarize_outcome(outcome, lab_cfg.rate, args.batch, lab_cfg.world_size)
    if "error" in row:
        return {"algorithm": name, "error": row["error"]}
    algorithm = registry.get(name, **CONFIG.get(name, {}))
    compute = _compute(outcome.ranks, shapes)
    pred = predict(algorithm, job_compute(name, compute, extra_s), network, costs.get(name))
    return {"algorithm": name, "measured_s": row["step_s"], "predicted_s": pred.step_s,
            "error": None, "rel_error": pred.step_s / row["step_s"] - 1.0,
            "wire_predicted": pred.wire_bytes, "wire_reported": row["reported_bytes_per_step"],
            "parts": [pred.compute_s, pred.compress_s, pred.exposed_s],
            "schedule": pred.describe_schedule(),
            "cpu": {k: row.get(k) for k in ("cpu_s", "cpu_sys_s", "compute_cpu_s", "compute_s")},
            "compute": compute.to_json()}  # the model's input: predictions can be redone


def run_setting(args: argparse.Namespace, bandwidth: str, report: dict[str, Any]
                ) -> dict[str, Any]:
    """Probe, then every model x algorithm (and auto) on one fresh lab; the report is
    saved after each model."""
    cfg = LabConfig(hosts=args.hosts, bandwidth="unshaped" if args.loopback else bandwidth)
    lab_cls: Any = LoopbackLab if args.loopback else NetworkLab
    out: dict[str, Any] = {"bandwidth": bandwidth, "models": {}}
    report["settings"].append(out)
    with lab_cls(cfg) as lab:
        probe_dir = Path(args.out) / f"probe-{bandwidth}"
        probe_dir.mkdir(parents=True, exist_ok=True)
        network, _ = run_in_lab(lab, probe_dir)  # costs: per model, on its shapes
        out["network"] = network.to_json()
        for model in args.models.split(","):
            res: dict[str, Any] = {"cells": [], "auto": None}
            if not args.only_buckets:
                res = _run_model(args, lab, cfg, bandwidth, model, network)
            if args.buckets or args.only_buckets:
                res["buckets"] = bucket_study(args, lab, cfg, model)
            out["models"][model] = res
            (Path(args.out) / "validation.json").write_text(json.dumps(report, indent=1))
    return out


def model_costs(names: list[str], profile: ComputeProfile, world: int,
                configs: dict[str, dict[str, Any]] | None = None, reps: int = 1
                ) -> dict[str, CompressorCost]:
    """Each algorithm's compressor timed on ``profile``'s tensor shapes, as auto times them
    (:func:`hexagram.cost.measure.local_costs`, this thread's CPU seconds), on one intra-op
    thread as the lab's ranks run: with more, OpenMP's spinning workers showed up as 20x
    outliers in the calling thread's CPU while the lab's ranks held the cores. ``configs``
    (default :data:`CONFIG`): each algorithm's configuration. ``reps`` > 1: timed that
    many times, each coefficient the median (a re-prediction on a machine others use: one
    timing came out 3x on a busy moment)."""
    configs = CONFIG if configs is None else configs
    algos = [(n, registry.get(n, **configs.get(n, {}))) for n in names]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [local_costs(algos, profile, world) for _ in range(max(1, reps))]
    finally:
        torch.set_num_threads(threads)
    return {lb: _median_cost([r[lb] for r in runs]) for lb in runs[0]}


def _median_cost(costs: list[CompressorCost]) -> CompressorCost:
    """Each coefficient's median over ``costs`` (one timing each)."""
    def med(get: Any) -> tuple[float, float]:
        pairs = [get(c) for c in costs]
        return (statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs))
    tree = None if costs[0].tree is None else TreeCost(
        med(lambda c: c.tree.once), med(lambda c: c.tree.per_round))
    return CompressorCost(med(lambda c: c.compress), med(lambda c: c.decompress), tree)


def _run_model(args: argparse.Namespace, lab: Any, cfg: LabConfig, bandwidth: str,
               model: str, network: NetworkProfile) -> dict[str, Any]:
    """Every algorithm (and auto) on ``model`` in one series: predicted vs measured."""
    work = build_workload(ModelSpec(name=model, **MODELS[model]))
    shapes = [tuple(p.shape) for p in work.model.parameters() if p.requires_grad]
    names = args.algorithms.split(",") if args.algorithms else sync_algorithms()
    specs_ = [TensorSpec(f"p{i}", s) for i, s in reversed(list(enumerate(shapes)))]
    costs = model_costs(names, static_profile([], specs_), cfg.world_size)
    specs = [_spec(args, model, n, CONFIG.get(n, {}), args.warmup) for n in names]
    if args.auto:  # 12 untimed steps: profile, decide, time the buckets
        specs.append({**_spec(args, model, "auto", {"verbose": False}, 12),
                      "steps": max(args.steps, 10), "min_steps": 10})
    print(f"{bandwidth} {model}: {', '.join(s['label'] for s in specs)}", file=sys.stderr,
          flush=True)
    outcomes = run_series(lab, specs, timeout=args.timeout)
    extra = optimizer_extra_s(shapes) if "qadam" in names else 0.0
    cells = [_cell(n, o, args, cfg, shapes, network, costs, extra)
             for n, o in zip(names, outcomes)]
    auto = None
    if args.auto:
        row = summarize_outcome(outcomes[-1], cfg.rate, args.batch, cfg.world_size)
        auto = {"error": row["error"]} if "error" in row else {
            "measured_s": row["step_s"], "decision": outcomes[-1].ranks[0].get("decision")}
    return {"cells": cells, "auto": auto}


def measured_config(name: str, started: str) -> dict[str, Any]:
    """The configuration a run started at ``started`` (``"YYYY-mm-dd HH:MM:SS UTC"``)
    measured for ``name``: the bench's (:data:`CONFIG`), with the defaults of the time
    (:data:`MEASURED_AS`).

    >>> measured_config("randomk", "2026-11-25 19:52:42 UTC")["density"]
    0.25
    >>> measured_config("randomk", "2026-11-26 03:00:00 UTC")
    {}
    """
    out: dict[str, Any] = dict(CONFIG.get(name, {}))
    for changed, algo, old in MEASURED_AS:
        if algo == name and started[:19] < changed:
            out.update(old)
    return out


def repredict(folder: Path, compute: str = "cell", reps: int = 5) -> dict[str, Any]:
    """Redo every cell's prediction of a saved run (``validation.json`` and the probe files
    beside it) with the current model: the measurements stay, the model may change; the
    compressors are timed again here, on each workload's shapes. ``compute="cell"``: each
    cell from the local compute its own run recorded; ``"common"``: every cell of a
    workload from one profile (the median local step among its cells), as ``auto``
    predicts all candidates from the profile of its first steps. ``reps``: compressor
    timings per workload, each coefficient their median (:func:`model_costs`)."""
    report = json.loads((folder / "validation.json").read_text())
    started = report.get("started", "")
    for setting in report["settings"]:
        network, _ = load_probe(folder / f"probe-{setting['bandwidth']}" / "probe.json")
        for res in setting["models"].values():
            cells = [c for c in res["cells"] if c.get("error") is None and "compute" in c]
            if not cells:
                continue
            profiles = [ComputeProfile.from_json(c["compute"]) for c in cells]
            common = sorted(profiles, key=lambda p: p.step_s)[len(profiles) // 2]
            configs = {c["algorithm"]: measured_config(c["algorithm"], started) for c in cells}
            costs = model_costs(list(configs), profiles[0], network.world, configs, reps)
            shapes = [t.shape for t in profiles[0].tensors]
            extra = optimizer_extra_s(shapes) if "qadam" in configs else 0.0
            for c, own in zip(cells, profiles):
                algorithm = registry.get(c["algorithm"], **configs[c["algorithm"]])
                job = job_compute(c["algorithm"], common if compute == "common" else own,
                                  extra)
                pred = predict(algorithm, job, network, costs.get(c["algorithm"]))
                c.update(predicted_s=pred.step_s, rel_error=pred.step_s / c["measured_s"] - 1,
                         parts=[pred.compute_s, pred.compress_s, pred.exposed_s],
                         wire_predicted=pred.wire_bytes, config=configs[c["algorithm"]])
                if pred.wire_bytes != c["wire_reported"]:
                    print(f"warning: {setting['bandwidth']} {c['algorithm']}: predicted "
                          f"{pred.wire_bytes} B/step, the run reported {c['wire_reported']}: "
                          "not the configuration it measured", file=sys.stderr)
    return report


def _load(paths: str) -> dict[str, Any]:
    """One report from comma-separated ``validation.json`` paths (settings joined), each
    cell with the configuration its run measured (:func:`measured_config`)."""
    settings = []
    for path in paths.split(","):
        report = json.loads(Path(path).read_text())
        for setting in report["settings"]:
            for res in setting["models"].values():
                for c in res.get("cells", []):
                    c.setdefault("config", measured_config(c["algorithm"],
                                                           report.get("started", "")))
            settings.append(setting)
    return {"settings": settings}


def _compare_main(pair: list[str], out: Path) -> int:
    rows = compare(_load(pair[0]), _load(pair[1]))
    text = compare_markdown(rows, "A", "B") + f"\n\nA: {pair[0]}\nB: {pair[1]}\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(text)
    (out / "compare.json").write_text(json.dumps({"a": pair[0], "b": pair[1], "rows": rows},
                                                 indent=1))
    print(text)
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line (module doc)."""
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--bandwidth", default="10mbit,100mbit,1gbit,unshaped")
    a.add_argument("--models", default="mlp,gpt,cnn")
    a.add_argument("--algorithms", default="", help="comma-separated (default: all sync)")
    a.add_argument("--hosts", type=int, default=4)
    a.add_argument("--batch", type=int, default=32)
    a.add_argument("--steps", type=int, default=6)
    a.add_argument("--warmup", type=int, default=2)
    a.add_argument("--compute-steps", type=int, default=10,
                   help="local steps each rank's compute profile is the median of")
    a.add_argument("--time-limit", type=float, default=30.0)
    a.add_argument("--timeout", type=float, default=600.0)
    a.add_argument("--auto", action="store_true", help="also run algorithm='auto'")
    a.add_argument("--buckets", action="store_true",
                   help="also the bucket study (allreduce, powersgd: fixed sizes vs auto)")
    a.add_argument("--only-buckets", action="store_true",
                   help="the bucket study alone (no model validation)")
    a.add_argument("--bucket-rounds", type=int, default=3,
                   help="bucket study: interleaved rounds of every configuration (1: the "
                        "single-run study)")
    a.add_argument("--bucket-steps", type=int, default=25,
                   help="bucket study: timed steps per cell (--time-limit still caps them)")
    a.add_argument("--bucket-algorithms", default="allreduce,powersgd",
                   help="bucket study: the algorithms (comma-separated)")
    a.add_argument("--loopback", action="store_true")
    a.add_argument("--out", required=True)
    a.add_argument("--repredict", action="store_true",
                   help="no lab: redo the predictions of the run saved in --out")
    a.add_argument("--compute", choices=("cell", "common"), default="cell",
                   help="with --repredict: each cell's own local compute, or one profile "
                        "per workload (as auto predicts)")
    a.add_argument("--timing-reps", type=int, default=5,
                   help="with --repredict: compressor timings per workload (median)")
    a.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="no lab: test-retest of two runs' validation.json files (each may "
                        "be several, comma-separated: their settings are joined); the "
                        "table goes to OUT/compare.{md,json}")
    return a


def main() -> int:
    args = _parser().parse_args()
    if args.compare:
        return _compare_main(args.compare, Path(args.out))
    if args.repredict:
        redone = repredict(Path(args.out), args.compute, args.timing_reps)
        text = markdown(redone)
        stem = "validation-repredicted" + ("-common" if args.compute == "common" else "")
        (Path(args.out) / f"{stem}.md").write_text(text)
        (Path(args.out) / f"{stem}.json").write_text(json.dumps(redone, indent=1))
        print(text)
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "settings": [],
                              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    for bw in args.bandwidth.split(","):
        run_setting(args, bw, report)
    report["machine"]["load_average_end"] = machine_info()["load_average"]
    text = markdown(report)
    (Path(args.out) / "validation.json").write_text(json.dumps(report, indent=1))
    (Path(args.out) / "validation.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
