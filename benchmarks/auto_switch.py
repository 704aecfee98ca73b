"""auto re-decides when the network changes under it: the link drops mid-run.

The scenario: 4 emulated hosts start at ``--start`` (1 Gbit/s), every rank trains
with ``algorithm="auto"``; once auto has decided and timed its buckets and run
``--settle`` more steps, every link is changed to ``--to`` (20 Mbit/s) with
``tc qdisc replace`` while the ranks run (:meth:`NetworkLab.set_rate`). Reported: the
decision before, the step at which the rate changed, the step at which auto switched (its
own log of the switch) and to what, and step times before, during and after. Target: the
switch within 30 steps of the change.

Usage (root, iproute2)::

    .venv/bin/python benchmarks/auto_switch.py --model mlp --out /tmp/auto-switch

Output: ``OUT/switch.json`` and a Markdown paragraph on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

MODELS = {"mlp": {"params": 6_300_000, "layers": 3}, "gpt": {"layers": 4, "width": 256},
          "cnn": {"width": 256}}


def rank_main(spec: dict[str, Any], out: Path) -> None:
    """One rank: train with auto for ``spec["steps"]`` steps, recording when each step
    started (wall clock, shared by the lab's namespaces) and what auto ran."""
    import hexagram as hx
    from hexagram.models.workload import ModelSpec, build_workload

    torch.set_num_threads(1)
    hx.init(timeout=120)
    rank = hx.get_runtime().rank
    work = build_workload(ModelSpec(name=spec["model"], **MODELS[spec["model"]]))
    opt = torch.optim.SGD(work.model.parameters(), lr=0.01, momentum=0.9)
    algo = hx.algorithms.get("auto", verbose=rank == 0)
    model = hx.DistributedDataParallel(work.model, optimizers=[opt], algorithm=algo)
    gen = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(spec["steps"]):
        x, y = work.batch(32, gen)
        t0 = time.time()
        work.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        rows.append({"step": step, "start": t0, "s": time.time() - t0, "label": algo.label,
                     "tuned": "tuned" in (algo.decision or {})})
        if rank == 0:
            (out / "progress.json").write_text(json.dumps(rows[-1]))
    result = {"rows": rows, "decision": algo.decision, "switches": algo.switches,
              "reprobes": algo.reprobes}
    model.close()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    hx.shutdown()


def _wait_settled(out: Path, settle: int, deadline: float) -> int:
    """Block until rank 0 has timed its buckets and run ``settle`` more steps."""
    tuned_at = None
    while time.monotonic() < deadline:
        try:
            row = json.loads((out / "progress.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            row = None
        if row is not None:
            if row["tuned"] and tuned_at is None:
                tuned_at = row["step"]
            if tuned_at is not None and row["step"] >= tuned_at + settle:
                return int(row["step"])
        time.sleep(0.05)
    raise TimeoutError("auto did not settle in time; see the rank logs")


def controller(args: argparse.Namespace) -> dict[str, Any]:
    from hexagram.bench.lab import LabConfig, NetworkLab

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"model": args.model, "steps": args.steps}
    (out / "spec.json").write_text(json.dumps(spec))
    with NetworkLab(LabConfig(hosts=args.hosts, bandwidth=args.start), workdir=out) as lab:
        procs = lab.spawn([sys.executable, os.path.abspath(__file__), "--rank-job", str(out)])
        deadline = time.monotonic() + args.timeout
        seen = _wait_settled(out, args.settle, deadline)
        lab.set_rate(args.to)
        changed = time.time()
        print(f"rate {args.start} -> {args.to} after step {seen}", file=sys.stderr)
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        if codes != [0] * len(procs):
            raise RuntimeError(f"ranks exited {codes}; see {out}/rank*.log")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(procs))]
    return summarize(ranks, changed, args)


def summarize(ranks: list[dict[str, Any]], changed: float, args: argparse.Namespace
              ) -> dict[str, Any]:
    rows = ranks[0]["rows"]
    change_step = next((r["step"] for r in rows if r["start"] >= changed), len(rows))
    switch = next((s for s in ranks[0]["switches"] if s["step"] > change_step - 1), None)
    worst = [max(r["rows"][i]["s"] for r in ranks) for i in range(len(rows))]

    def med(lo: int, hi: int) -> float | None:
        part = worst[max(0, lo):max(0, hi)]
        return statistics.median(part) if part else None

    after = switch["step"] if switch else len(rows)
    return {"start": args.start, "to": args.to, "model": args.model,
            "decision": ranks[0]["decision"], "change_step": change_step,
            "switch": switch, "steps_to_switch": (after - change_step) if switch else None,
            "before_s": med(change_step - 10, change_step),
            "drifting_s": med(change_step, after),
            "after_s": med(after + 3, len(rows)), "reprobes": ranks[0]["reprobes"],
            "same_label_on_all_ranks": all(
                [x["label"] for x in r["rows"]] == [x["label"] for x in rows] for r in ranks)}


def markdown(res: dict[str, Any]) -> str:
    sw = res["switch"]
    what = (f"auto switched {sw['from']} -> {sw['to']} at step {sw['step']}, "
            f"{res['steps_to_switch']} steps after the change" if sw else
            "auto did not switch")
    f = (lambda v: "-" if v is None else f"{v:.3f} s")  # noqa: E731
    return (f"{res['model']}: {res['start']} -> {res['to']} after step {res['change_step']}; "
            f"{what}. Step (slowest rank, median): before {f(res['before_s'])}, "
            f"drifting {f(res['drifting_s'])}, after {f(res['after_s'])}; re-probes "
            f"{res['reprobes']}; every rank ran the same algorithm at every step: "
            f"{res['same_label_on_all_ranks']}.")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-job":
        out = Path(sys.argv[2])
        rank_main(json.loads((out / "spec.json").read_text()), out)
        return 0
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--model", default="mlp", choices=sorted(MODELS))
    a.add_argument("--hosts", type=int, default=4)
    a.add_argument("--start", default="1gbit")
    a.add_argument("--to", default="20mbit")
    a.add_argument("--steps", type=int, default=80)
    a.add_argument("--settle", type=int, default=10)
    a.add_argument("--timeout", type=float, default=1200.0)
    a.add_argument("--out", required=True)
    args = a.parse_args()
    res = controller(args)
    (Path(args.out) / "switch.json").write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
