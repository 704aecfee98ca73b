"""The links inside and between hosts measured apart: the plan it gives, executed.

On the network lab (root: 2 emulated hosts x 2 ranks, ``--bandwidth`` between hosts, the
host's own loopback inside), every rank runs what ``hexagram.parallel.auto`` runs:
``measure_cluster`` on the reference GPT (compute, the two links fitted apart, framework
overheads, the model's own step and gradient sync), then rank 0 plans twice:

- ``apart``: the measured cluster as it is (``host_links.fit_host_links``);
- ``one link``: the same cluster with both links set to one all-rank allreduce fit, which
  is what ``measure_cluster`` priced both links with before the two were fitted apart.

Both plans are applied to the same GPT (same weights) and trained on the same random token
batches, in alternating blocks of steps (``--rounds`` x ``--block``; each block starts with
an untimed step), so load that drifts hits both. Per plan: the predicted step, the
measured step (median over timed steps of the slowest rank) and the ratio.

    sudo .venv/bin/python benchmarks/plan_hosts.py --bandwidth 100mbit
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's hexagram, also without PYTHONPATH
GPT_SHAPE = {"layers": 4, "width": 256, "block": 64, "batch": 16}


def _model(seed: int = 0) -> Any:
    import torch

    from hexagram.models import GPT, GPTConfig

    torch.manual_seed(seed)
    s = GPT_SHAPE
    return GPT(GPTConfig(vocab_size=96, block_size=s["block"], n_layer=s["layers"],
                         n_head=s["width"] // 64, n_embd=s["width"]))


def _plans(x0: Any) -> dict[str, Any]:
    """Measure the job (collective) and plan on the two clusters (rank 0; broadcast)."""
    import torch
    import torch.distributed as dist

    from hexagram.parallel import plan
    from hexagram.parallel.auto import measure_cluster
    from hexagram.parallel.calibrate import fit_links

    apart = measure_cluster(torch.float32, model=_model(), example_inputs=x0)
    one = fit_links(stat="median")
    flat = apart.replace(intra_latency_us=one["latency_us"], intra_host_gbps=one["gbps"],
                         inter_latency_us=one["latency_us"], inter_host_gbps=one["gbps"])
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box[0] = {"apart": (plan(_model(), x0, apart), apart),
                  "one link": (plan(_model(), x0, flat), flat)}
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank_main(spec: dict[str, Any], out: Path) -> None:
    """One rank: measure, plan twice, train both plans in alternating blocks."""
    import torch
    import torch.distributed as dist

    import hexagram as hx
    from hexagram.parallel import parallelize

    hx.init(timeout=300)
    s = GPT_SHAPE
    x0 = torch.zeros(s["batch"], s["block"], dtype=torch.long)
    plans = _plans(x0)
    runs = {}
    for name, (p, _) in plans.items():
        pm = parallelize(_model(), p, example_inputs=x0)
        runs[name] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(spec["rounds"]):
        for name, (pm, opt) in runs.items():
            for step in range(spec["block"] + 1):
                x = torch.randint(0, 96, (s["batch"], s["block"]), generator=gen)
                dist.barrier()
                t0 = time.perf_counter()
                pm.train_step(x, torch.roll(x, -1, dims=1))
                opt.step()
                opt.zero_grad()
                if step:  # the first step of a visit runs on caches the other plan filled
                    times[name].append(time.perf_counter() - t0)
    result = {"rank": dist.get_rank(), "times": times, "hexagram": hx.__file__,
              "plans": {n: str(p) for n, (p, _) in plans.items()},
              "predicted": {n: p.step_time_s for n, (p, _) in plans.items()},
              "links": {n: [c.intra_latency_us, c.intra_host_gbps, c.inter_latency_us,
                            c.inter_host_gbps] for n, (_, c) in plans.items()}}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    hx.shutdown()


def _report(ranks: list[dict[str, Any]], args: argparse.Namespace, wall: float) -> str:
    first = ranks[0]
    lines = [f"2 hosts x 2 ranks, {args.bandwidth} between hosts (network lab); GPT "
             f"{GPT_SHAPE}; {args.rounds} rounds x {args.block} timed steps per plan; "
             f"wall {wall:.0f} s; hexagram from {ROOT}", ""]
    for name, text in first["plans"].items():
        a_us, a_g, e_us, e_g = first["links"][name]
        lines += [f"### {name}: links {a_us:.0f} us + {a_g:.3f} Gbit/s inside a host, "
                  f"{e_us:.0f} us + {e_g:.3f} Gbit/s between hosts", "", text, ""]
    lines += ["| cluster the plan was made on | predicted ms/step | measured ms/step | "
              "measured/predicted |", "|---|---|---|---|"]
    for name, predicted in first["predicted"].items():
        steps = zip(*(r["times"][name] for r in ranks))  # slowest rank per step
        measured = statistics.median(max(t) for t in steps)
        lines.append(f"| {name} | {predicted * 1e3:.1f} | {measured * 1e3:.1f} | "
                     f"{measured / predicted:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", default="100mbit", help="link rate between hosts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block", type=int, default=10, help="timed steps per visit")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--rank-mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_mode:
        out = Path(args.rank_mode)
        rank_main(json.loads((out / "spec.json").read_text()), out)
        return 0
    from hexagram.bench.lab import LabConfig, NetworkLab

    with tempfile.TemporaryDirectory(prefix="hexagram-hosts-") as tmp, \
            NetworkLab(LabConfig(hosts=2, ranks_per_host=2, bandwidth=args.bandwidth,
                                 prefix="hxp")) as lab:
        (Path(tmp) / "spec.json").write_text(json.dumps(vars(args)))
        t0 = time.perf_counter()
        results = lab.run([sys.executable, __file__, "--rank-mode", tmp],
                          timeout=args.timeout, env={"PYTHONPATH": str(ROOT)})
        failed = lab.ranks_failed_message(results)
        if failed:
            raise RuntimeError(failed)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
        print(_report(ranks, args, time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
