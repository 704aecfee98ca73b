"""Relaxations inside plans: planned and measured.

``plan``: the planner on a GPT on 4 hosts x 8 devices with 10 Gbit/s between hosts, with
the dp sync fixed to allreduce (the default) and with ``Constraints(dp_algorithms=(
"allreduce", "fp16", "powersgd"))``: the predicted step times and both plans.

``lab`` (root: network namespaces): 2 emulated hosts x 2 ranks, shaped links between hosts,
the reference GPT (hexagram.models.GPT) on the shipped text corpus (Python's docs,
characters), a pp=2 x dp=2 plan whose stage k runs on rank k of each host: pipeline
transfers stay inside a host, each stage's dp pair crosses the slow link. The same plan is
trained twice from the same weights and batches, its stages synchronised by allreduce and by
PowerSGD; per run: mean step time (slowest rank), bytes the busiest host sent on its link
per step (interface counter), training loss at the end (mean of the last 20 steps) and the
validation loss of the trained model (16 x 64 fixed windows of the held-out text).

The PowerSGD run uses the config the planner emits for a relaxed stage
(``relax_cost.planned_options("powersgd")``); ``--ranks 4,8`` adds hand-set ranks. The last
lines print the ratios against the allreduce run of the same command.

    python benchmarks/plan_relax.py plan
    sudo .venv/bin/python benchmarks/plan_relax.py lab --steps 200 --bandwidth 100mbit
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's hexagram, also without PYTHONPATH
WORKER_DEFAULTS = {"layers": 4, "width": 256, "block": 64, "batch": 16, "microbatches": 2,
                   "lr": 1e-3, "steps": 200, "seed": 0}


def _plan_rows(gbps: float) -> None:
    import torch

    from hexagram.parallel import Cluster, Constraints, gpt, plan

    model = gpt(layers=12, hidden=1024, heads=16, device="meta")
    x = torch.zeros(128, 1024, dtype=torch.long, device="meta")
    cluster = Cluster(hosts=4, devices_per_host=8, inter_host_gbps=gbps)
    print(f"GPT-12 h1024 ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M), global "
          f"batch 128 x 1024 tokens, 4x8 devices, {gbps:g} Gbit/s between hosts\n")
    for algos in (("allreduce",), ("allreduce", "fp16", "powersgd")):
        t0 = time.perf_counter()
        p = plan(model, x, cluster, Constraints(dp_algorithms=algos))
        print(f"dp_algorithms={algos}: planned in {time.perf_counter() - t0:.1f} s\n{p}\n")


def _stage_ranks(plan: Any) -> Any:
    """Stage k on rank k of each host (hosts of 2 ranks): dp pairs cross hosts."""
    stages = [dataclasses.replace(s, ranks=[k, k + 2]) for k, s in enumerate(plan.stages)]
    return dataclasses.replace(plan, stages=stages)


def _valid_loss(pm: Any, fresh: Any, corpus: Any, spec: dict[str, Any]) -> float | None:
    """Validation loss of the trained model (stages' parameters gathered on rank 0; the
    stage modules keep the model's parameter names): 16 batches of 64 fixed windows."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {n: t.cpu() for n, t in pm.full_parameters().items()})
    if dist.get_rank() != 0:
        return None
    loaded = fresh.load_state_dict({k: v for part in parts for k, v in part.items()},
                                   strict=False)
    missing = set(loaded.missing_keys) & {n for n, _ in fresh.named_parameters()}
    if missing:
        raise RuntimeError(f"stages did not return parameters {sorted(missing)[:3]}")
    gen, total = torch.Generator().manual_seed(1234), 0.0
    with torch.no_grad():
        for _ in range(16):
            x, y = corpus.batch("valid", 64, spec["block"], gen)
            total += F.cross_entropy(fresh(x).reshape(-1, 96), y.reshape(-1)).item() / 16
    return total


def rank_main(spec: dict[str, Any], out: Path) -> None:
    """One rank: plan (rank 0), apply, train ``steps`` steps; write ``rank<r>.json``."""
    import torch
    import torch.distributed as dist

    import hexagram as hx
    from hexagram.data.text import load_text
    from hexagram.models import GPT, GPTConfig
    from hexagram.parallel import Cluster, Constraints, parallelize, plan
    from hexagram.parallel.relax import stage_sync

    hx.init()
    torch.manual_seed(spec["seed"])
    cfg = GPTConfig(vocab_size=96, block_size=spec["block"], n_layer=spec["layers"],
                    n_head=max(1, spec["width"] // 64), n_embd=spec["width"])
    model = GPT(cfg)
    corpus = load_text()
    x0 = torch.zeros(spec["batch"], spec["block"], dtype=torch.long)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box[0] = _stage_ranks(plan(model, x0, Cluster(hosts=1, devices_per_host=4,
                                                      dtype_bytes=4),
                                   Constraints(pp=2, dp=2, tp=1,
                                               microbatches=spec["microbatches"])))
    dist.broadcast_object_list(box, src=0)
    stages = [dataclasses.replace(s, dp_algorithm=spec["algorithm"],
                                  dp_options=dict(spec["options"])) for s in box[0].stages]
    p = dataclasses.replace(box[0], stages=stages)
    pm = parallelize(model, p, example_inputs=x0)
    opt = torch.optim.AdamW(pm.parameters(), lr=spec["lr"])
    losses, times = [], []
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    for _ in range(spec["steps"]):
        x, y = corpus.batch("train", spec["batch"], spec["block"], gen)
        t0 = time.perf_counter()
        loss = pm.train_step(x, y)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    sync = stage_sync(pm.module)
    result = {"rank": dist.get_rank(), "stage": pm.stage_index, "times": times,
              "hexagram": hx.__file__,
              "losses": losses, "plan": p.to_json(indent=None),
              "valid_loss": _valid_loss(pm, GPT(cfg), corpus, spec),
              "bytes_counted": sync.bytes_sent() if sync is not None else None,
              "stage_params": sum(q.numel() for q in pm.module.parameters())}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    hx.shutdown()


def _run(lab: Any, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hexagram-relax-") as tmp:
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        tx0 = [lab.tx_bytes(h) for h in range(2)]
        t0 = time.perf_counter()
        results = lab.run([sys.executable, __file__, "--rank-mode", tmp], timeout=timeout,
                          env={"PYTHONPATH": str(ROOT)})  # this tree's hexagram
        wall = time.perf_counter() - t0
        tx = max(lab.tx_bytes(h) - tx0[h] for h in range(2))
        failed = lab.ranks_failed_message(results)
        if failed:
            raise RuntimeError(failed)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    wrong = {r["hexagram"] for r in ranks} - {str(ROOT / "hexagram" / "__init__.py")}
    if wrong:
        raise RuntimeError(f"rank processes imported hexagram from {sorted(wrong)}, not "
                           f"{ROOT}: check PYTHONPATH")
    return {"ranks": ranks, "wall_s": wall, "tx_bytes": tx}


def _metrics(run: dict[str, Any], skip: int) -> dict[str, float]:
    """Step time (slowest rank; mean over steps after ``skip`` and over all), link MB per
    step, first and last-20 training loss, validation loss, wall seconds."""
    ranks, steps = run["ranks"], len(run["ranks"][0]["times"])
    last = [r["losses"] for r in ranks if r["losses"][0] is not None]
    return {"s_step": max(sum(r["times"][skip:]) / (steps - skip) for r in ranks),
            "s_step_all": max(sum(r["times"]) / steps for r in ranks),
            "mb_step": run["tx_bytes"] / steps / 1e6,
            "first": sum(ls[0] for ls in last) / len(last),
            "train": sum(sum(ls[-20:]) / len(ls[-20:]) for ls in last) / len(last),
            "valid": next(r["valid_loss"] for r in ranks if r["valid_loss"] is not None),
            "wall": run["wall_s"]}


def _row(label: str, m: dict[str, float]) -> str:
    return (f"| {label} | {m['s_step']:.3f} | {m['s_step_all']:.3f} | {m['mb_step']:.2f} | "
            f"{m['first']:.3f} | {m['train']:.3f} | {m['valid']:.3f} | {m['wall']:.0f} |")


def _ratios(label: str, m: dict[str, float], base: dict[str, float]) -> str:
    """``label`` against the allreduce run: speed-up (>1: faster), link bytes, losses."""
    return (f"{label} vs allreduce: {base['s_step'] / m['s_step']:.2f}x faster per step "
            f"({base['s_step_all'] / m['s_step_all']:.2f}x over all steps), "
            f"{base['mb_step'] / m['mb_step']:.1f}x fewer link bytes, train loss "
            f"{(m['train'] / base['train'] - 1) * 100:+.2f} %, validation loss "
            f"{(m['valid'] / base['valid'] - 1) * 100:+.2f} %")


def lab_main(args: argparse.Namespace) -> None:
    from hexagram.bench.lab import LabConfig, NetworkLab
    from hexagram.parallel.relax_cost import planned_options

    base = {**WORKER_DEFAULTS, "steps": args.steps}
    planned = planned_options("powersgd")
    runs = [("allreduce", "allreduce", {})] if args.allreduce else []
    label = "powersgd " + ", ".join(f"{k} {v}" for k, v in planned.items()) + " (planned)"
    runs += [(label, "powersgd", planned)] if args.planned else []
    runs += [(f"powersgd rank {r}", "powersgd", {"rank": r}) for r in args.ranks]
    done: list[tuple[str, dict[str, float]]] = []
    with NetworkLab(LabConfig(hosts=2, ranks_per_host=2, bandwidth=args.bandwidth,
                              prefix="hxr")) as lab:
        for label, name, opts in runs:
            run = _run(lab, {**base, "algorithm": name, "options": opts}, args.timeout)
            done.append((label, _metrics(run, args.skip)))
            print(_row(*done[-1]), flush=True)
    stage = json.loads(run["ranks"][0]["plan"])["stages"]
    print(f"\n2 hosts x 2 ranks, {args.bandwidth} between hosts; GPT {base['layers']} layers, "
          f"width {base['width']}, block {base['block']}, global batch {base['batch']}, "
          f"{base['microbatches']} micro-batches, AdamW lr {base['lr']}, {args.steps} steps; "
          f"stages on ranks {[s['ranks'] for s in stage]}; hexagram from {ROOT}\n")
    print(f"| dp sync | s/step (steps > {args.skip}) | s/step (all) | MB/step on busiest host "
          "link | loss step 1 | loss, last 20 steps | validation loss | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(_row(label, m) for label, m in done))
    if done and done[0][0] == "allreduce":
        print("\n" + "\n".join(_ratios(label, m, done[0][1]) for label, m in done[1:]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=("plan", "lab"), default="plan")
    parser.add_argument("--gbps", type=float, default=10.0, help="plan: inter-host Gbit/s")
    parser.add_argument("--bandwidth", default="100mbit", help="lab: link rate")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip", type=int, default=20, help="steps left out of the mean")
    parser.add_argument("--ranks", type=lambda t: [int(v) for v in t.split(",")],
                        default=[], help="hand-set PowerSGD ranks to run too, e.g. 4,8")
    parser.add_argument("--no-planned", dest="planned", action="store_false",
                        help="skip the run with the planner's PowerSGD config")
    parser.add_argument("--no-allreduce", dest="allreduce", action="store_false",
                        help="skip the allreduce run")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    parser.add_argument("--rank-mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_mode:
        out = Path(args.rank_mode)
        rank_main(json.loads((out / "spec.json").read_text()), out)
    elif args.mode == "plan":
        _plan_rows(args.gbps)
    else:
        lab_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
