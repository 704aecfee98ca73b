"""``hexagram advise``: predict every algorithm's step time for a network and a model.

Without running every algorithm: the network comes from a probe file (``--probe``, written
by ``python -m hexagram.bench.task`` or ``--save-probe``) or is probed now on the lab's
emulated hosts (``--hosts``, ``--bandwidth``; ``--loopback`` without root); the model's step
is profiled here (``--model`` a reference model, or ``--module pkg.mod:factory``); the
step-time model (:mod:`hexagram.cost`) prints the predicted table and the recommendation.

``--from REPORT.json`` (a ``hexagram bench --json`` report) still names the fastest
measured algorithm per bandwidth, and now also shows predicted against measured (with the
probe file if given, else a network assumed from the bandwidth label, marked as such).

Compressed and delayed algorithms change the optimisation: confirm a choice with
``hexagram train`` (time to accuracy).

Example:
    $ hexagram advise --hosts 4 --bandwidth 100mbit --model mlp --save-probe probe.json
    $ hexagram advise --probe probe.json --module mypkg.models:factory
    $ hexagram advise --from bench.json --probe probe.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from typing import Any

import torch

from hexagram.bench.cli import add_lab_arguments, add_model_arguments
from hexagram.bench.lab import LabUnavailableError, parse_rate
from hexagram.cli_options import add, checked, existing_file, fail

__all__ = ["add_arguments", "assumed_network", "load_factory", "recommend", "run"]


def _registered() -> list[str]:
    from hexagram.algorithms import registry

    return [n for n in registry.names() if n != "auto"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--from``/``--probe``/``--module``, the candidates, the lab and the model."""
    a = parser.add_argument
    a("--from", dest="source", type=existing_file, metavar="FILE",
      help="a `hexagram bench --json` report")
    a("--probe", type=existing_file, metavar="FILE",
      help="a probe file (python -m hexagram.bench.task, or --save-probe)")
    a("--save-probe", metavar="FILE", help="write the probe made now to this file")
    a("--module", type=checked(_factory_spec), metavar="PKG.MOD:FACTORY",
      help="profile the model of pkg.mod:factory (returns a Workload-like object "
      "with model, batch(n, generator), loss(out, y); or a (model, batch_fn, loss_fn) tuple)")
    add(parser, "algorithms", known=_registered, allow_all=False, aliases=("candidates",),
        note="the candidates (default: auto's)")
    a("--allow-delay", action="store_true", help="also local SGD, DiLoCo, decentralized")
    a("--lossless", action="store_true", help="only exact-sum algorithms")
    add_lab_arguments(parser, note="the first of a comma list is probed")
    add_model_arguments(parser, params=6_300_000, layers=3, width=256)
    add(parser, "batch", default=32, note="of the profiled step")


def recommend(rows: list[dict[str, Any]], min_efficiency: float = 0.0) -> dict[str, Any]:
    """The fastest algorithm of one bandwidth's summaries (errors skipped), with its speed-up
    over ``ddp``; ``min_efficiency`` drops algorithms far from their bound."""
    ok = [r for r in rows if "error" not in r and r["efficiency"] >= min_efficiency]
    if not ok:
        raise ValueError("no algorithm ran successfully in this report")
    best = min(ok, key=lambda r: r["step_s"])
    ddp = next((r for r in ok if r["algorithm"] == "ddp"), None)
    hexagram_rows = [r for r in ok if not r["algorithm"].startswith("ddp")]
    best_hx = min(hexagram_rows, key=lambda r: r["step_s"]) if hexagram_rows else None
    return {"best": best["algorithm"], "best_step_s": best["step_s"],
            "best_hexagram": best_hx["algorithm"] if best_hx else None,
            "speedup_vs_ddp": ddp["step_s"] / best["step_s"] if ddp else None}


def assumed_network(bandwidth: str, world: int, hosts: int) -> Any:
    """A network profile from a link rate label (not measured: 1 ms latency, one ring
    flow at 94 % of the rate, all-to-all and two-neighbour exchange at 70 %, the lab's
    measured figures; ``unshaped``/``loopback``: 1 GB/s)."""
    from hexagram.cost.probe import COLLECTIVES, Fit, NetworkProfile

    rate = parse_rate(bandwidth) if bandwidth != "loopback" else None
    bps = rate / 8 if rate else 1e9
    share = {"allreduce": 0.94, "allgather": 0.94, "alltoall": 0.7, "p2p": 0.7}
    fits = {k: Fit(0.001, bps * share[k]) for k in COLLECTIVES}
    return NetworkProfile(world, hosts, fits, notes=[f"assumed from '{bandwidth}', not probed"])


def _factory_spec(spec: str) -> tuple[str, str]:
    """``pkg.mod:factory`` -> ``("pkg.mod", "factory")`` (SystemExit naming the form)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise SystemExit(f"--module {spec!r}: expected pkg.mod:factory")
    return mod_name, attr


def load_factory(spec: str) -> tuple[torch.nn.Module, Any, Any]:
    """``pkg.mod:factory`` -> (model, batch() -> (x, y), loss(out, y))."""
    mod_name, attr = _factory_spec(spec)
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"--module {spec!r}: {exc}") from None
    made = factory()
    if isinstance(made, tuple):
        return made[0], made[1], made[2]
    gen = torch.Generator().manual_seed(0)
    return made.model, lambda: made.batch(32, gen), made.loss


def _load_probe(path: str) -> tuple[Any, dict[str, Any]]:
    """:func:`hexagram.bench.task.load_probe`, a malformed file as one line (SystemExit)."""
    from hexagram.bench.task import load_probe

    try:
        return load_probe(path)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise SystemExit(f"--probe {path}: not a probe file ({type(exc).__name__}: {exc}); "
                         "write one with --save-probe") from None


def _workload(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, Any]:
    if args.module:
        return load_factory(args.module)
    from hexagram.models.workload import ModelSpec, build_workload

    work = build_workload(ModelSpec(name=args.model, params=args.params, layers=args.layers,
                                    width=args.width, block=args.seq))
    gen = torch.Generator().manual_seed(0)
    return work.model, lambda: work.batch(args.batch, gen), work.loss


def _probe_now(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    from hexagram.bench.harness import LoopbackLab
    from hexagram.bench.lab import LabConfig, NetworkLab
    from hexagram.bench.task import run_in_lab, save_probe

    bandwidth = args.bandwidth.split(",")[0]
    cfg = LabConfig(hosts=args.hosts, ranks_per_host=args.ranks_per_host,
                    bandwidth="unshaped" if args.loopback else bandwidth)
    lab_cls: Any = LoopbackLab if args.loopback else NetworkLab
    with tempfile.TemporaryDirectory(prefix="hexagram-probe-") as tmp, lab_cls(cfg) as lab:
        network, costs = run_in_lab(lab, tmp)
    if args.save_probe:
        save_probe(args.save_probe, network, costs)
    return network, costs


def _predict(args: argparse.Namespace, network: Any, costs: dict[str, Any]) -> int:
    from hexagram.auto import choose
    from hexagram.bench.task import measure_costs
    from hexagram.cost.profile import profile_module

    model, batch, loss = _workload(args)
    compute = profile_module(model, batch, loss)
    labels = args.algorithms.split(",") if args.algorithms else None
    candidates = choose.resolve(labels, args.allow_delay, not args.lossless)
    missing = [lb for lb, _ in candidates if lb not in costs]
    costs = {**measure_costs(missing), **costs}
    preds = choose.predict_all(candidates, compute, network, costs)
    best = preds[0]
    why = f"fastest predicted, {best.describe_schedule()}"
    print(f"network: {network.world} ranks on {network.hosts} host(s); "
          + "; ".join(f"{k} {f.latency_s * 1e3:.2f} ms + {8 * f.rate_bps / 1e6:.0f} Mbit/s"
                      for k, f in network.fits.items())
          + "".join(f"\nnote: {n}" for n in network.notes))
    print(f"compute (this process): {compute.step_s:.3f} s/step, backward "
          f"{compute.backward_s:.3f} s")
    print(choose.format_table(preds, best.label, why))
    print(f"recommendation: algorithm=hx.algorithms.get({best.label.split(':')[0]!r}"
          + "".join(f", {k}={v!r}" for k, v in choose.parse_label(best.label)[1].items())
          + f"), bucket_size_mb={best.bucket_bytes / 2**20:g}; or algorithm='auto'")
    return 0


def _from_report(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Fastest measured per bandwidth, and predicted against measured."""
    from hexagram.algorithms import registry
    from hexagram.bench.task import measure_costs
    from hexagram.cost.model import predict_any
    from hexagram.cost.profile import profile_module

    settings = report.get("settings", {})
    if "block" in settings:  # a report from before --block was spelled --seq
        settings = {"seq": settings["block"], **settings}
    for key in ("model", "params", "layers", "width", "seq", "batch"):
        if key in settings:
            setattr(args, key, settings[key])
    model, batch, loss = _workload(args)
    compute = profile_module(model, batch, loss)
    hosts = settings.get("hosts", args.hosts)
    world = hosts * settings.get("ranks_per_host", 1)
    for bandwidth, rows in report["results"].items():
        network, costs = _load_probe(args.probe) if args.probe else \
            (assumed_network(bandwidth, world, hosts), {})
        print(f"\n{bandwidth}: predicted against measured ({network.notes or 'probed'})")
        print("| algorithm | predicted s | measured s | error |\n|---|---|---|---|")
        for r in rows:
            name = r["algorithm"]
            if "error" in r or name not in registry.names() or name == "auto":
                continue
            cost = costs.get(name) or measure_costs([name]).get(name)
            p = predict_any(registry.get(name), compute, network, {name: cost} if cost else {})
            print(f"| {name} | {p.step_s:.3f} | {r['step_s']:.3f} | "
                  f"{100 * (p.step_s / r['step_s'] - 1):+.0f} % |")


def run(args: argparse.Namespace) -> int:
    """Print the prediction (or a report's recommendation); 2 when the lab is unavailable."""
    if not args.source:
        try:
            network, costs = _load_probe(args.probe) if args.probe else _probe_now(args)
        except LabUnavailableError as exc:
            print(f"hexagram advise: {exc}", file=sys.stderr)
            return 2
        return _predict(args, network, costs)
    try:
        with open(args.source) as f:
            report = json.load(f)
        report["results"].items()
    except (ValueError, KeyError, TypeError, AttributeError):
        return fail("hexagram advise", f"--from {args.source}: not a `hexagram bench --json` "
                    "report (JSON with a 'results' mapping)")
    for bandwidth, rows in report["results"].items():
        advice = recommend(rows)
        speed = (f", {advice['speedup_vs_ddp']:.1f}x the step rate of PyTorch DDP"
                 if advice["speedup_vs_ddp"] else "")
        print(f"{bandwidth}: use {advice['best']} ({advice['best_step_s']:.3f} s/step{speed}); "
              f"fastest Hexagram algorithm: {advice['best_hexagram']}")
    _from_report(args, report)
    print("Compressed and delayed algorithms change convergence: check time to accuracy "
          "with `hexagram train --algorithms ...` before adopting one.")
    return 0

