"""``hexagram simulate``: the table, JSON and plot of :func:`hexagram.cost.simulate.simulate`.

Example:
    $ hexagram simulate --model mlp --world 8,64,512,4096 --devices-per-host 8 \\
        --inter 25gbe --device h100 --algorithms allreduce,powersgd,topk,gtopk
    $ hexagram simulate --model gpt --layers 24 --width 2048 --seq 1024 --batch 8 \\
        --world 8,64,512,4096 --inter 25gbe --json - --plot gpt.png
    $ hexagram simulate --model uniform --params 10500000 --world 4 --devices-per-host 1 \\
        --inter 100mbit --backend gloo     # the network lab's cluster
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hexagram.cli_options import add, fail, int_list, positive_float, positive_int

# Only torch-free modules here, so that `hexagram simulate --help` starts in a fraction of
# a second: the simulator (torch, every algorithm) is imported by the functions that run it.
from hexagram.cost.collectives import BACKENDS
from hexagram.cost.devices import EFFICIENCY, LINKS, device
from hexagram.errors import ConfigError, require

if TYPE_CHECKING:
    from hexagram.cost.profile import CompressorCost, ComputeProfile
    from hexagram.cost.simulate import Row

__all__ = ["EXAMPLE", "EXAMPLE_ARGS", "add_arguments", "format_rows", "plot_rows", "run"]

EXAMPLE_ARGS = ("--model mlp --world 8,64,512,4096 --devices-per-host 8 --inter 25gbe "
                "--device h100 --algorithms allreduce,powersgd,topk,gtopk")
EXAMPLE = ("example (6.3 M-parameter MLP on 8-H100 hosts, 25 Gbit/s between hosts):\n"
           "  hexagram simulate " + EXAMPLE_ARGS.replace(" --inter", " \\\n    --inter"))


def _efficiency(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction in (0, 1]")
    return float(value)


def _registered() -> list[str]:
    from hexagram.algorithms import registry

    return list(registry.names())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hexagram simulate``."""
    parser.epilog = EXAMPLE
    add(parser, "model", choices=("mlp", "cnn", "gpt", "uniform"), default="mlp",
        note="built on the meta device; uniform: --params in --layers equal square layers "
        "(a transformer-like profile)")
    add(parser, "params", default=6_300_000, aliases=("model-params",),
        note="uniform: its total")
    add(parser, "layers", note="default 3; uniform: 24")
    add(parser, "width", default=256)
    add(parser, "seq", default=64, aliases=("block",))
    add(parser, "batch", default=32, note="one rank per device")
    a = parser.add_argument
    a("--world", type=int_list, default="8,64,512,4096", metavar="N,N,...",
      help="world sizes (devices), comma list")
    a("--devices-per-host", type=positive_int, default=8, help="devices in a host")
    add(parser, "intra", default="nvlink", note=f"one of {', '.join(LINKS)}")
    add(parser, "inter", default="25gbe")
    a("--inter-links", type=positive_int, default=1, help="uplinks per host")
    a("--oversubscription", type=positive_float, default=1.0,
      help="the fabric's oversubscription above the hosts (1: full bisection)")
    a("--backend", choices=BACKENDS, default="nccl",
      help="whose collective schedules: nccl (ring or tree by size), gloo "
      "(ring), mpi (MPICH: recursive doubling / halving-doubling)")
    add(parser, "device", default="h100", allow_local=True,
        note="a100, h100, h200 (compressors priced from the H200 measurements on h100/h200) "
        "or local (measure here)")
    a("--efficiency", type=_efficiency, default=EFFICIENCY,
      help="fraction of peak FLOP/s reached (device profiles)")
    add(parser, "algorithms", default="all", known=_registered, note="or 'all'")
    add(parser, "bucket-mb", default=25.0)
    add(parser, "json", nargs="?", const="-", note="without FILE: to stdout")
    add(parser, "plot", note="step time against world size")


def _compute(args: argparse.Namespace) -> ComputeProfile:
    from hexagram.cost.simulate import device_compute, params_tensors, reference_tensors

    if args.model == "uniform":
        tensors, tokens = params_tensors(args.params, args.layers or 24), 1
    else:
        tensors, tokens = reference_tensors(args.model, args.params, args.layers or 3,
                                            args.width, args.seq)
    if args.device.lower() != "local":
        return device_compute(tensors, device(args.device), args.batch, tokens,
                              args.efficiency)
    if args.model == "uniform":
        raise ConfigError("--device local measures a registered --model; --model uniform "
                          "has no runnable model: use --device a100, h100 or h200")
    from hexagram.cost.profile import profile_module
    from hexagram.models.workload import ModelSpec, build_workload

    work = build_workload(ModelSpec(name=args.model, params=args.params,
                                    layers=args.layers or 3, width=args.width,
                                    block=args.seq))
    return profile_module(work.model, lambda: work.batch(args.batch, None), work.loss)


def _local_costs(labels: Sequence[str]) -> dict[str, CompressorCost]:
    """Each lossy label's compressor timed on this machine's CPU (``--device local``)."""
    from hexagram.auto.choose import make
    from hexagram.auto.simulate import skip_reason
    from hexagram.cost.facts import compressor_of
    from hexagram.cost.profile import measure_compressor

    out = {}
    for label in labels:
        if skip_reason(label) is None:
            comp = compressor_of(make(label))
            if comp is not None:
                out[label] = measure_compressor(comp)
    return out


def _pricing(device_name: str) -> str:
    """Where the table's compression times come from, for the line under it."""
    from hexagram.cost.gpu_measured import MEASURED_DEVICES, SOURCE

    if device_name.lower() in MEASURED_DEVICES:
        return f"the {SOURCE}; compressors not measured there are taken as memory-bound"
    return (f"an assumption: memory-bound kernels at the {device_name} datasheet's HBM rate "
            "(no measurement of this device)")


def format_rows(rows: Sequence[Row]) -> str:
    """A Markdown table: one row per algorithm and world size."""
    out = ["| algorithm | world | step ms | compute ms | exposed comm ms | compression ms "
           "| MB/device/step | speed-up vs allreduce |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.step_s is None:
            out.append(f"| {r.label} | {r.world} | {r.note} | | | | | |")
            continue
        out.append(f"| {r.label} | {r.world} | {r.step_s * 1e3:.2f} | {r.compute_s * 1e3:.2f}"
                   f" | {r.exposed_s * 1e3:.2f} | {r.compress_s * 1e3:.2f} | "
                   f"{r.bytes / 1e6:.2f} | {r.speedup:.2f}x |")
    return "\n".join(out)


def plot_rows(rows: Sequence[Row], path: str | Path, title: str = "") -> None:
    """Step time against world size (log-log), one line per algorithm."""
    matplotlib = require("matplotlib", extra="bench", feature="plotting")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label in dict.fromkeys(r.label for r in rows):
        pts = [(r.world, r.step_s * 1e3) for r in rows if r.label == label and r.step_s]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size (devices)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(title or "hexagram simulate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Simulate, print the table (or JSON), write the plot; 2 on bad input."""
    from hexagram.algorithms import registry
    from hexagram.auto.simulate import simulate
    from hexagram.cost.simulate import Cluster

    try:
        labels = ([n for n in registry.names()] if args.algorithms == "all"
                  else [a.strip() for a in args.algorithms.split(",") if a.strip()])
        cluster = Cluster(devices_per_host=args.devices_per_host, intra=args.intra,
                          inter=args.inter, inter_links=args.inter_links,
                          oversubscription=args.oversubscription, backend=args.backend)
        dev = None if args.device.lower() == "local" else device(args.device)
        rows = simulate(labels, args.world, _compute(args), cluster, dev,
                        args.bucket_mb, None if dev is not None else _local_costs(labels))
    except (ConfigError, ValueError) as exc:
        return fail("hexagram simulate", exc)
    if args.json is not None:
        text = json.dumps([r.to_json() for r in rows], indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    if args.json != "-":
        print(format_rows(rows))
        if dev is not None:
            print(f"\ncompressors priced from {_pricing(dev.name)}")
    if args.plot:
        plot_rows(rows, args.plot, f"{args.model} on "
                  f"{args.device}, {args.devices_per_host}/host, {args.inter} between hosts")
    return 0
