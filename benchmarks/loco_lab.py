"""Past DiLoCo in the network lab: time to a target validation loss on slow links.

The language model, data and methods of :mod:`loco_lm` (same GPT, batch, optimizers and
algorithm configs), trained by 4 emulated hosts (:class:`hexagram.bench.lab.NetworkLab`,
one rank each, every link shaped to ``--bandwidth``) until the mean validation loss over
the ranks' models is at or below ``--target`` (by default DDP's final loss in a loopback
``loco_lm`` run of the same model, read from ``--target-from``), or until the method's
``--time-limit`` of training time. The clock counts training steps only (not the
evaluations), the slowest rank's, as ``hexagram train`` does.

``none`` is the same run with no communication at all: every rank trains its own model,
nothing on the wire. Its mean step time times a method's steps to the target is that
method's compute bound: what its run would take on an infinitely fast network. A method
whose lab time is close to its compute bound is not slowed down by the network.

Methods too slow to reach the target within their time limit (DDP at 10 Mbit/s: one
allreduce of the whole model per step) report their measured lab step time; the table
projects their time to the target from it and their steps to the target on loopback,
marked as projected. Step times are means after the first 3 steps (warm-up).

Usage (root, iproute2; the run of docs/benchmarks/loco.md, about 16 minutes)::

    .venv/bin/python benchmarks/loco_lab.py --bandwidth 10mbit \\
        --target-from benchmarks/results/loco/lm_3m_s0_2026-11-27.json \\
        --max-steps 1200 --eval-every 10 --time-limit 400 --limit none=60 --limit ddp=120 \\
        --methods none,sparseloco-H=10,diloco-H=50,ddp --out /tmp/loco-lab

Output: ``OUT/loco_lab.json`` and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loco_lm import METHODS, make_model, model_arguments

NONE = "none"  # no communication: the compute bound


def _wrap(method: str, net: nn.Module, opt: torch.optim.Optimizer) -> Any:
    import hexagram as hx

    if method == NONE:
        return None
    algo, config, _ = METHODS[method]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DeMo's takeover notice
        return hx.DistributedDataParallel(net, optimizers=[opt],
                                          algorithm=hx.algorithms.get(algo, **config))


def _agree(val: float, clock: float) -> tuple[float, float]:
    """(mean validation loss over the ranks, the slowest rank's clock): every rank stops at
    the same step."""
    t = torch.tensor([val, clock], dtype=torch.float64)
    dist.all_reduce(t[:1])
    dist.all_reduce(t[1:], op=dist.ReduceOp.MAX)
    return float(t[0]) / dist.get_world_size(), float(t[1])


def _val_loss(net: nn.Module, windows: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        logits = net(windows[0])
        return float(nn.functional.cross_entropy(logits.flatten(0, 1), windows[1].flatten()))


def train(method: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank's run of ``method`` until the target, ``max_steps`` or the time limit."""
    from hexagram.data.text import load_text

    _, _, opt_kind = METHODS.get(method, ("", {}, "adamw"))
    args = argparse.Namespace(**spec)
    corpus = load_text()
    net, opt = make_model(opt_kind, args.seed, args)
    model = _wrap(method, net, opt)
    val = corpus.batch("valid", 32, args.block, torch.Generator().manual_seed(12345))
    gen = torch.Generator().manual_seed(1000 * args.seed + dist.get_rank())
    limit = spec["time_limits"].get(method, spec["time_limit"])
    clock, times, curve, reached = 0.0, [], [], None
    for step in range(1, args.max_steps + 1):
        x, y = corpus.batch("train", args.batch, args.block, gen)
        t0 = time.perf_counter()
        nn.functional.cross_entropy((model or net)(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        clock += times[-1]
        if step % args.eval_every == 0:
            loss, wall = _agree(_val_loss(net, val), clock)
            curve.append({"step": step, "clock_s": wall, "val": loss,
                          "bytes": model.bytes_sent() if model else 0})
            if reached is None and loss <= args.target:
                reached = curve[-1]
            if reached is not None or wall > limit:
                break
    if model is not None:
        model.close()
    return {"method": method, "curve": curve, "reached": reached, "step_times": times,
            "params": sum(p.numel() for p in net.parameters())}


def rank_main(out: Path, method: str) -> None:
    import hexagram as hx

    torch.set_num_threads(1)
    hx.init(timeout=900)
    spec = json.loads((out / "spec.json").read_text())
    result = train(method, spec)
    (out / f"{method}.rank{dist.get_rank()}.json").write_text(json.dumps(result))
    hx.shutdown()


def _target(args: argparse.Namespace) -> tuple[float, int | None]:
    """The target loss and DDP's loopback steps to it (None where given by hand)."""
    if args.target is not None:
        return args.target, None
    runs = json.loads(Path(args.target_from).read_text())["results"]
    ddp = next(r for r in runs if r["method"] == "ddp" and r["seed"] == args.seed)
    target = ddp["curve"][-1]["val"]
    return target, next(p["step"] for p in ddp["curve"] if p["val"] <= target)


def controller(args: argparse.Namespace, target: float) -> dict[str, dict[str, Any]]:
    from hexagram.bench.lab import LabConfig, NetworkLab

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = {k: v for k, v in vars(args).items() if k not in ("target_from", "out")}
    spec["target"] = target
    spec["time_limits"] = dict(kv.split("=", 1) for kv in args.limit) if args.limit else {}
    spec["time_limits"] = {k: float(v) for k, v in spec["time_limits"].items()}
    (out / "spec.json").write_text(json.dumps(spec))
    results: dict[str, dict[str, Any]] = {}
    with NetworkLab(LabConfig(hosts=args.world, bandwidth=args.bandwidth), workdir=out) as lab:
        for method in args.methods.split(","):
            limit = spec["time_limits"].get(method, args.time_limit)
            ranks = lab.run([sys.executable, str(Path(__file__).resolve()), "--rank-job",
                             str(out), method], timeout=3 * limit + 600)
            if any(r.returncode != 0 for r in ranks):
                raise RuntimeError(f"{method}: {lab.ranks_failed_message(ranks)}")
            runs = [json.loads((out / f"{method}.rank{r}.json").read_text())
                    for r in range(args.world)]
            results[method] = runs[0] | {"step_times": [max(ts) for ts in zip(
                *(r["step_times"] for r in runs))]}  # the slowest rank's each step
            print(f"done {method}: {results[method]['curve'][-1]}", file=sys.stderr,
                  flush=True)
    return results


def _compute_step(results: dict[str, dict[str, Any]]) -> float | None:
    """Mean step time of the no-communication run after its first 3 steps (warm-up): a
    mean, as the methods' clocks sum every step, slow ones included."""
    none = results.get(NONE)
    return statistics.fmean(none["step_times"][3:] or none["step_times"]) if none else None


def summarize(results: dict[str, dict[str, Any]], target: float, ddp_steps: int | None
              ) -> list[dict[str, Any]]:
    """One row per method: lab time to the target (or projected), compute bound, ratio."""
    step_none = _compute_step(results)
    rows = []
    for method, r in results.items():
        if method == NONE:
            continue
        step_s = statistics.fmean(r["step_times"][3:] or r["step_times"])
        last, reached = r["curve"][-1], r["reached"]
        row = {"method": method, "mean_step_s": step_s, "final_step": last["step"],
               "final_val": last["val"], "mb_sent": last["bytes"] / 1e6, "projected": False,
               "steps_to_target": reached["step"] if reached else None,
               "time_to_target_s": reached["clock_s"] if reached else None}
        if reached is None and method == "ddp" and ddp_steps is not None:
            row.update(steps_to_target=ddp_steps, time_to_target_s=ddp_steps * step_s,
                       projected=True)
        if row["steps_to_target"] is not None and step_none is not None:
            row["compute_bound_s"] = row["steps_to_target"] * step_none
            row["vs_compute_bound"] = row["time_to_target_s"] / row["compute_bound_s"]
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], target: float, args: argparse.Namespace,
             step_none: float | None) -> str:
    head = (f"Target: validation loss <= {target:.4f}; {args.world} hosts at {args.bandwidth}; "
            f"no-communication step (mean, slowest rank): "
            f"{'-' if step_none is None else f'{step_none:.3f} s'}\n\n"
            "| method | steps to target | time to target | compute bound | vs compute bound "
            "| mean step | MB sent / rank | last step: val |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        t, bound = r["time_to_target_s"], r.get("compute_bound_s")
        when = "not reached" if t is None else f"{t:.0f} s" + (
            " (projected)" if r["projected"] else "")
        ratio = f"{r['vs_compute_bound']:.2f}x" if "vs_compute_bound" in r else "-"
        lines.append(
            f"| {r['method']} | {r['steps_to_target'] or '-'} | {when} | "
            f"{'-' if bound is None else f'{bound:.0f} s'} | {ratio} | "
            f"{r['mean_step_s']:.3f} s | {r['mb_sent']:.3f} | "
            f"{r['final_step']}: {r['final_val']:.4f} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--rank-job":
        rank_main(Path(sys.argv[2]), sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bandwidth", default="10mbit")
    p.add_argument("--methods", default=f"{NONE},sparseloco-H=10,diloco-H=50,ddp")
    p.add_argument("--target", type=float, default=None, help="validation loss to reach")
    p.add_argument("--target-from", default="", help="a loco_lm JSON: its DDP's final loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--time-limit", type=float, default=600.0,
                   help="training seconds per method (the clock excludes evaluation)")
    p.add_argument("--limit", action="append", default=[], metavar="METHOD=SECONDS",
                   help="a method's own time limit, e.g. ddp=120 none=30")
    model_arguments(p)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.target is None and not args.target_from:
        p.error("give --target LOSS or --target-from a loco_lm JSON with a ddp run")
    unknown = [m for m in args.methods.split(",") if m != NONE and m not in METHODS]
    if unknown:
        p.error(f"unknown methods {unknown}; choose among {NONE}, {', '.join(METHODS)}")
    target, ddp_steps = _target(args)
    results = controller(args, target)
    rows = summarize(results, target, ddp_steps)
    step_none = _compute_step(results)
    (Path(args.out) / "loco_lab.json").write_text(json.dumps(
        {"args": vars(args), "target": target, "ddp_loopback_steps": ddp_steps,
         "rows": rows, "results": results}, indent=1))
    print(markdown(rows, target, args, step_none))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
