"""``hexagram plan``: plan a GPT or MLP stack for a described cluster, print and save it.

Example:
    $ hexagram plan --model gpt --layers 24 --hidden 1024 --cluster 2x8 --json plan.json
    $ hexagram plan --model mlp --layers 16 --hidden 4096 --cluster 1x8 --memory-gb 16 \\
          --baselines
    $ hexagram plan --model gpt --layers 2 --hidden 64 --heads 4 --vocab 128 --seq 16 \\
          --batch 8 --cluster 1x2 --execute --steps 5
    $ hexagram plan --model gpt --layers 12 --cluster 4x8 --inter-gbps 10 \\
          --dp-algorithms fp16,powersgd
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import torch

from hexagram.errors import ConfigError, HexagramError
from hexagram.parallel.baselines import baselines
from hexagram.parallel.cluster import Cluster, Constraints
from hexagram.parallel.graph import ModelGraph, capture
from hexagram.parallel.models import gpt, mlp_stack
from hexagram.parallel.planner import plan_graph
from hexagram.parallel.relax_cost import PRICED

__all__ = ["add_arguments", "build_graph", "constraints", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, cluster and constraint options of ``hexagram plan``."""
    m = parser.add_argument_group("model (built on the meta device: no memory)")
    m.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    m.add_argument("--layers", type=int, default=24)
    m.add_argument("--hidden", type=int, default=1024)
    m.add_argument("--heads", type=int, default=16)
    m.add_argument("--vocab", type=int, default=50257)
    m.add_argument("--seq", type=int, default=1024)
    m.add_argument("--batch", type=int, default=128, help="global batch (sequences/samples)")
    c = parser.add_argument_group("cluster")
    c.add_argument("--cluster", default="1x8", help="HOSTSxDEVICES, e.g. 2x8")
    c.add_argument("--intra-gbps", type=float, default=2400.0, help="Gbit/s inside a host")
    c.add_argument("--inter-gbps", type=float, default=200.0, help="Gbit/s of a host's NIC")
    c.add_argument("--memory-gb", type=float, default=80.0, help="memory per device (GB)")
    c.add_argument("--tflops", type=float, default=150.0, help="achievable TFLOP/s per device")
    c.add_argument("--intra", default=None, metavar="PRESET",
                   help="link preset inside a host, as `hexagram simulate` (nvlink, pcie4, ...): "
                        "with --inter, the rates and latencies come from the presets")
    c.add_argument("--inter", default=None, metavar="PRESET",
                   help="link preset between hosts (25gbe, 100mbit, ...)")
    c.add_argument("--device", default=None, metavar="PRESET",
                   help="device preset (h100, a100, ...): its memory and FLOP/s at the cost "
                        "model's efficiency, instead of --memory-gb and --tflops")
    k = parser.add_argument_group("constraints (default: the planner chooses)")
    for name in ("pp", "tp", "dp", "microbatches"):
        k.add_argument(f"--{name}", type=int, default=None)
    k.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    k.add_argument("--dp-algorithms", default="allreduce", metavar="NAMES",
                   help="comma-separated gradient algorithms a stage's data-parallel sync may "
                        "use besides allreduce (always included), e.g. fp16,powersgd; priced: "
                        + ", ".join(PRICED))
    parser.add_argument("--json", default=None, help="write the plan as JSON to this file")
    parser.add_argument("--baselines", action="store_true",
                        help="also evaluate hand-made strategies with the same cost model")
    parser.add_argument("--execute", action="store_true",
                        help="calibrate this machine as a 1xN cluster (N from --cluster; "
                             "framework overheads and the model's own measured step), plan "
                             "for it, run the plan on N local ranks for --steps steps (float64) "
                             "and print measured vs predicted step time")
    parser.add_argument("--steps", type=int, default=5, help="steps of --execute")


def constraints(args: argparse.Namespace) -> Constraints:
    """The constraint options as :class:`Constraints`; ``--dp-algorithms`` names checked
    against the priced algorithms (ConfigError naming the unknown ones and the valid)."""
    names = [n.strip() for n in str(args.dp_algorithms).split(",") if n.strip()]
    unknown = [n for n in names if n not in PRICED]
    if unknown:
        raise ConfigError(f"--dp-algorithms: {', '.join(map(repr, unknown))} not priced by "
                          f"the planner; choose among {', '.join(PRICED)} "
                          f"(comma-separated, e.g. --dp-algorithms fp16,powersgd)")
    algos = ("allreduce", *dict.fromkeys(n for n in names if n != "allreduce"))
    return Constraints(pp=args.pp, tp=args.tp, dp=args.dp, microbatches=args.microbatches,
                       schedule=args.schedule, dp_algorithms=algos)


def build_graph(args: argparse.Namespace) -> ModelGraph:
    """Capture the described model on the meta device."""
    if args.model == "gpt":
        model = gpt(layers=args.layers, hidden=args.hidden, heads=args.heads,
                    vocab=args.vocab, seq=args.seq, device="meta")
        x = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    else:
        model = mlp_stack(layers=args.layers, hidden=args.hidden, in_features=args.hidden,
                          classes=1000, device="meta")
        x = torch.zeros(args.batch, args.hidden, device="meta")
    return capture(model, x)


def calibrate_worker(spec: Any) -> dict[str, float]:
    """Every rank of ``--execute``'s calibration job: the framework calibration
    (``measure_job``) and the model's own step against the roofline (``compute_scale``)."""
    from hexagram import runtime as hx  # init() only: the runtime, not the package root
    from hexagram.parallel.calibrate import measure_job
    from hexagram.parallel.verify import build

    hx.init()
    model, x, y = build(spec)
    return measure_job(spec.dtype, model=model, inputs=x, targets=y)


def execute(args: argparse.Namespace, cluster: Cluster, cons: Constraints) -> int:
    """``--execute``: calibrate, plan and run on local ranks; print measured vs predicted."""
    import statistics

    from hexagram.launch import run_local
    from hexagram.parallel.calibrate import calibrated, with_model_figures
    from hexagram.parallel.plans import Plan
    from hexagram.parallel.verify import ParitySpec, parity_worker

    if cluster.hosts != 1:
        raise HexagramError(f"--execute runs on this machine's local ranks: use --cluster "
                            f"1x{cluster.devices}, not {args.cluster}")
    spec = ParitySpec(model=args.model, layers=args.layers, hidden=args.hidden,
                      heads=args.heads, vocab=args.vocab, seq=args.seq, batch=args.batch,
                      steps=max(args.steps, 2), constraints={
                          k: v for k, v in cons.__dict__.items() if v is not None},
                      reference=False)
    figures = run_local(calibrate_worker, cluster.devices, args=(spec,), timeout=600)[0]
    local = with_model_figures(calibrated(figures, cluster.devices, spec.dtype), figures)
    spec = dataclasses.replace(spec, cluster=local)
    res = run_local(parity_worker, cluster.devices, args=(spec,), timeout=600)
    executed = Plan.from_json(res[0]["plan"])
    measured = statistics.median(max(r["times"][k] for r in res)
                                 for k in range(1, spec.steps))
    print(executed)
    print(f"  executed {spec.steps} steps on {cluster.devices} local ranks: measured "
          f"{measured * 1e3:.1f} ms/step (median after the first), predicted "
          f"{executed.step_time_s * 1e3:.1f} ms/step, ratio "
          f"{measured / executed.step_time_s:.2f}")
    return 0


def cluster_of(args: argparse.Namespace) -> Cluster:
    """The cluster of the command line: numeric rates, or the presets ``hexagram simulate``
    takes (one hardware description, :mod:`hexagram.cost.hardware`)."""
    if args.intra is None and args.inter is None and args.device is None:
        return Cluster.parse(args.cluster, intra_host_gbps=args.intra_gbps,
                             inter_host_gbps=args.inter_gbps,
                             device_memory_gb=args.memory_gb, device_tflops=args.tflops)
    if args.intra is None or args.inter is None:
        raise ConfigError("--intra and --inter go together (link presets inside and between "
                          "hosts, e.g. --intra nvlink --inter 25gbe)")
    shape = Cluster.parse(args.cluster)
    fields = {} if args.device else {"device_memory_gb": args.memory_gb,
                                     "device_tflops": args.tflops}
    return Cluster.from_presets(shape.hosts, shape.devices_per_host, intra=args.intra,
                                inter=args.inter, device=args.device, **fields)


def run(args: argparse.Namespace) -> int:
    """Plan, print, optionally compare with baselines, save or execute; 2 on bad input."""
    if args.execute:
        try:
            return execute(args, Cluster.parse(args.cluster), constraints(args))
        except (ConfigError, HexagramError) as exc:
            print(f"hexagram plan: {exc}", file=sys.stderr)
            return 2
    try:
        cluster = cluster_of(args)
        cons = constraints(args)
        graph = build_graph(args)
        start = time.perf_counter()
        result = plan_graph(graph, cluster, cons)
    except (ConfigError, HexagramError) as exc:
        print(f"hexagram plan: {exc}", file=sys.stderr)
        return 2
    print(result)
    print(f"  planned in {time.perf_counter() - start:.1f} s")
    if args.baselines:
        for base in baselines(graph, cluster):
            text = base.plan.summary() if base.plan else "does not fit"
            print(f"  {base.name:24s} {text}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())
        print(f"  wrote {args.json}")
    return 0
