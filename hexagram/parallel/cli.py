"""``hexagram plan``: plan a GPT or MLP stack for a described cluster, print and save it.

Example:
    $ hexagram plan --model gpt --layers 24 --width 1024 --cluster 2x8 --json plan.json
    $ hexagram plan --model mlp --layers 16 --width 4096 --cluster 1x8 --memory-gb 16 \\
          --baselines
    $ hexagram plan --model gpt --layers 2 --width 64 --heads 4 --vocab 128 --seq 16 \\
          --global-batch 8 --cluster 1x2 --execute --steps 5
    $ hexagram plan --model gpt --layers 12 --cluster 4x8 --inter-gbps 10 \\
          --dp-algorithms fp16,powersgd
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch

from hexagram.cli_options import add, checked, fail, moved, positive_float, positive_int
from hexagram.config import did_you_mean
from hexagram.errors import ConfigError, HexagramError
from hexagram.parallel.baselines import baselines
from hexagram.parallel.cluster import Cluster, Constraints
from hexagram.parallel.graph import ModelGraph, capture
from hexagram.parallel.models import gpt, mlp_stack
from hexagram.parallel.planner import plan_graph
from hexagram.parallel.relax_cost import PRICED

__all__ = ["add_arguments", "build_graph", "constraints", "run"]


def _cluster_shape(text: str) -> str:
    """``HOSTSxDEVICES`` with positive counts, e.g. ``2x8``."""
    hosts, sep, devices = text.lower().partition("x")
    if not (sep and hosts.isdigit() and devices.isdigit() and int(hosts) and int(devices)):
        raise argparse.ArgumentTypeError(f"{text!r} must look like HOSTSxDEVICES, e.g. 2x8")
    return text


def dp_algorithm_names(text: str) -> tuple[str, ...]:
    """``--dp-algorithms``: allreduce first, then the other names, each priced by the
    planner (ConfigError naming the unknown ones and the valid)."""
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    unknown = [n for n in names if n not in PRICED]
    if unknown:
        raise ConfigError(f"--dp-algorithms: {', '.join(map(repr, unknown))} not priced by "
                          f"the planner; choose among {', '.join(PRICED)} "
                          f"(comma-separated, e.g. --dp-algorithms fp16,powersgd)"
                          f"{did_you_mean(unknown[0], PRICED)}")
    return ("allreduce", *dict.fromkeys(n for n in names if n != "allreduce"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, cluster and constraint options of ``hexagram plan``."""
    m = parser.add_argument_group("model (built on the meta device: no memory)")
    add(m, "model", choices=("gpt", "mlp"), default="gpt")
    add(m, "layers", default=24)
    add(m, "width", default=1024, aliases=("hidden",), note="MLP: its hidden width")
    m.add_argument("--heads", type=positive_int, default=16, help="attention heads (GPT)")
    m.add_argument("--vocab", type=positive_int, default=50257, help="vocabulary size (GPT)")
    add(m, "seq", default=1024)
    add(m, "global-batch", default=128)
    moved(m, "batch", "the planner takes the global batch as --global-batch (--batch is "
          "the per-rank batch in every command)")
    _cluster_arguments(parser)
    k = parser.add_argument_group("constraints (default: the planner chooses)")
    for name in ("pp", "tp", "dp", "microbatches"):
        k.add_argument(f"--{name}", type=positive_int, default=None,
                       help=f"impose this {_DEGREES[name]}")
    k.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                   help="pipeline schedule")
    k.add_argument("--dp-algorithms", type=checked(dp_algorithm_names), default="allreduce",
                   metavar="NAMES",
                   help="comma-separated gradient algorithms a stage's data-parallel sync may "
                        "use besides allreduce (always included), e.g. fp16,powersgd; priced: "
                        + ", ".join(PRICED))
    add(parser, "json", note="here, the plan")
    parser.add_argument("--baselines", action="store_true",
                        help="also evaluate hand-made strategies with the same cost model")
    parser.add_argument("--execute", action="store_true",
                        help="calibrate this machine as a 1xN cluster (N from --cluster; "
                             "framework overheads and the model's own measured step), plan "
                             "for it, run the plan on N local ranks for --steps steps (float64) "
                             "and print measured vs predicted step time")
    add(parser, "steps", default=5, note="of --execute")


_DEGREES = {"pp": "number of pipeline stages", "tp": "tensor-parallel degree",
            "dp": "data-parallel degree", "microbatches": "number of micro-batches per step"}


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("cluster")
    c.add_argument("--cluster", type=_cluster_shape, default="1x8",
                   help="HOSTSxDEVICES, e.g. 2x8")
    c.add_argument("--intra-gbps", type=positive_float, default=2400.0,
                   help="Gbit/s inside a host")
    c.add_argument("--inter-gbps", type=positive_float, default=200.0,
                   help="Gbit/s of a host's NIC")
    c.add_argument("--memory-gb", type=positive_float, default=80.0,
                   help="memory per device (GB)")
    c.add_argument("--tflops", type=positive_float, default=150.0,
                   help="achievable TFLOP/s per device")
    add(c, "intra", note="with --inter, the rates and latencies come from the presets "
        "instead of --intra-gbps and --inter-gbps")
    add(c, "inter", note="goes with --intra")
    add(c, "device", note="h100, a100, ...: its memory and FLOP/s at the cost model's "
        "efficiency, instead of --memory-gb and --tflops")


def constraints(args: argparse.Namespace) -> Constraints:
    """The constraint options as :class:`Constraints`; ``--dp-algorithms`` names checked
    against the priced algorithms (ConfigError naming the unknown ones and the valid)."""
    return Constraints(pp=args.pp, tp=args.tp, dp=args.dp, microbatches=args.microbatches,
                       schedule=args.schedule,
                       dp_algorithms=dp_algorithm_names(args.dp_algorithms))


def build_graph(args: argparse.Namespace) -> ModelGraph:
    """Capture the described model on the meta device."""
    if args.model == "gpt":
        model = gpt(layers=args.layers, hidden=args.width, heads=args.heads,
                    vocab=args.vocab, seq=args.seq, device="meta")
        x = torch.zeros(args.global_batch, args.seq, dtype=torch.long, device="meta")
    else:
        model = mlp_stack(layers=args.layers, hidden=args.width, in_features=args.width,
                          classes=1000, device="meta")
        x = torch.zeros(args.global_batch, args.width, device="meta")
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
    spec = ParitySpec(model=args.model, layers=args.layers, hidden=args.width,
                      heads=args.heads, vocab=args.vocab, seq=args.seq, batch=args.global_batch,
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
            return fail("hexagram plan", exc)
    try:
        cluster = cluster_of(args)
        cons = constraints(args)
        graph = build_graph(args)
        start = time.perf_counter()
        result = plan_graph(graph, cluster, cons)
    except (ConfigError, HexagramError) as exc:
        return fail("hexagram plan", exc)
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
