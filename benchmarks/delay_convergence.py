"""Convergence with ``delay=1`` against the same algorithm without delay.

Two tasks, 4 ranks started by :func:`hexagram.launch.run_local` (loopback, one thread each),
every algorithm trained twice with the same seeds, data order and optimizer: ``delay=0`` and
``delay=1``. Both runs end with ``model.synchronize()`` (for ``delay=1`` it applies the last
step's pending gradient), then the metric is taken on rank 0's replica (every gradient
algorithm keeps replicas identical; the script checks it).

- ``images``: Fashion-MNIST (Debian package ``dataset-fashion-mnist``), an MLP
  784-``hidden``-10, SGD with momentum 0.9 (QAdam: its own optimizer), ``--epochs`` epochs
  over each rank's interleaved shard; metric: test accuracy (10,000 images). Target of the
  issue: ``delay=1`` within 1 point of ``delay=0`` after 5 epochs.
``delay=1`` runs with weight prediction (the default, :mod:`hexagram.algorithms.predict`)
unless ``--no-predict`` is given.

- ``gpt``: the small character GPT on :mod:`hexagram.data.text`, AdamW (QAdam: its own),
  ``--steps`` steps; metrics: validation loss after the last step and the mean training loss
  of the last 50 steps (over ranks). Target: ``delay=1`` within 3 % at step 500.

Results are written to ``--json`` after every algorithm (``--resume`` skips those there).

Example:
    $ PYTHONPATH=. nice -n 19 python benchmarks/delay_convergence.py images --epochs 5 \\
        --json benchmarks/results/delay_fmnist.json --markdown delay_fmnist.md
    $ PYTHONPATH=. nice -n 19 python benchmarks/delay_convergence.py gpt --steps 500 \\
        --algorithms allreduce,powersgd,topk,qsgd --json benchmarks/results/delay_gpt.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WORLD = 4
#: every registered gradient algorithm but ``auto`` (it picks one of these by measuring)
ALGORITHMS = ("allreduce,fp16,powersgd,bytegrad,qsgd,terngrad,onebit,efsign,signsgd,topk,"
              "gtopk,dgc,randomk,qadam,robust")


def _model_and_data(spec: dict[str, Any], rank: int) -> tuple[nn.Module, Any]:
    """The task's model (seeded, so equal on every rank) and its data source."""
    if spec["task"] == "gpt":
        from hexagram.data import load_text
        from hexagram.models import GPT, GPTConfig

        corpus = load_text()
        cfg = GPTConfig(vocab_size=corpus.vocab_size, block_size=spec["block"],
                        n_layer=spec["layers"], n_head=max(1, spec["width"] // 64),
                        n_embd=spec["width"])
        torch.manual_seed(spec.get("seed", 0))
        return GPT(cfg), corpus
    from hexagram.data import load, shard
    from hexagram.models import mlp

    data = load("fashion-mnist")
    x, y = shard(data.x_train, data.y_train, rank, WORLD)
    side = data.x_train.shape[-1]
    torch.manual_seed(spec.get("seed", 0))
    return mlp(side * side, spec["hidden"], 1, data.classes), (data, x, y)


def _batches(spec: dict[str, Any], source: Any, rank: int) -> list[tuple[Tensor, Tensor]]:
    """Every training batch of the run, in order (the same for delay 0 and 1)."""
    batch = spec["batch"]
    if spec["task"] == "gpt":
        g = torch.Generator().manual_seed(1000 + rank + 10_000 * spec.get("seed", 0))
        return [source.batch("train", batch, spec["block"], g) for _ in range(spec["steps"])]
    _, x, y = source
    out = []
    for epoch in range(spec["epochs"]):
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(
            97 * epoch + rank + 10_000 * spec.get("seed", 0)))
        out += [(x[perm[i:i + batch]], y[perm[i:i + batch]])
                for i in range(0, len(y) - batch + 1, batch)]
    return out


def _loss(spec: dict[str, Any], out: Tensor, y: Tensor) -> Tensor:
    if spec["task"] == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


@torch.no_grad()
def _metric(spec: dict[str, Any], net: nn.Module, source: Any) -> float:
    """Test accuracy in % (images) or validation loss (gpt) of ``net``."""
    net.eval()
    if spec["task"] == "gpt":
        g = torch.Generator().manual_seed(12345)
        valid = [source.batch("valid", 32, spec["block"], g) for _ in range(16)]
        return sum(float(_loss(spec, net(x), y)) for x, y in valid) / len(valid)
    data = source[0]
    correct = sum(int((net(x).argmax(1) == y).sum())
                  for x, y in zip(data.x_test.split(2000), data.y_test.split(2000)))
    return 100.0 * correct / len(data.y_test)


def _train(spec: dict[str, Any], name: str, delay: int) -> dict[str, Any]:
    """One training run on this rank; returns its metric, losses and training seconds."""
    import torch.distributed as dist

    import hexagram as hx
    from hexagram.bench.loop import train_step
    from hexagram.bench.peers import make_optimizer

    rank = dist.get_rank()
    net, source = _model_and_data(spec, rank)
    if spec["task"] == "gpt" or name == "qadam" or spec.get("adamw"):
        opt = make_optimizer(name, net.parameters(), spec["lr"],
                             adaptive=spec["task"] == "gpt" or spec.get("adamw", False),
                             warmup=50)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=spec["lr"], momentum=spec["momentum"],
                              nesterov=spec["nesterov"])
    options = {"predict": spec["predict"]} if delay else {}
    algo = hx.algorithms.get(name, delay=delay, **options, **spec["config"].get(name, {}))
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)
    step = train_step(model, opt, lambda out, y: _loss(spec, out, y))
    t0 = time.perf_counter()
    losses = [float(step(x, y)) for x, y in _batches(spec, source, rank)]
    model.synchronize()  # delay=1: the last step's gradient is applied here
    seconds = time.perf_counter() - t0
    metric = _metric(spec, net, source)
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    model.close()
    return {"metric": metric, "losses": losses, "seconds": seconds,
            "checksum": float(flat.double().sum()), "steps": len(losses)}


def _worker(spec: dict[str, Any], name: str) -> dict[int, dict[str, Any]]:
    import hexagram as hx

    hx.init()
    return {delay: _train(spec, name, delay) for delay in spec["delays"]}


def _summary(spec: dict[str, Any], ranks: list[dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per delay: rank 0's metric, the ranks' mean loss of the last 50 steps, seconds."""
    row: dict[str, Any] = {}
    for delay in spec["delays"]:
        runs = [r[delay] for r in ranks]
        if len({r["checksum"] for r in runs}) != 1:
            raise RuntimeError(f"delay={delay}: replicas differ after synchronize()")
        tail = [sum(r["losses"][-50:]) / len(r["losses"][-50:]) for r in runs]
        row[str(delay)] = {"metric": runs[0]["metric"], "tail_loss": sum(tail) / len(tail),
                           "seconds": max(r["seconds"] for r in runs),
                           "steps": runs[0]["steps"]}
    return row


def markdown(spec: dict[str, Any], rows: dict[str, Any]) -> str:
    """The table of ``rows`` (algorithm -> summary) with the gap and the target's verdict."""
    gpt = spec["task"] == "gpt"
    unit = "valid loss" if gpt else "test accuracy (%)"
    lines = [f"| algorithm | {unit}, delay=0 | delay=1 | gap | train loss (last 50), "
             "delay=0 / delay=1 | target |", "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        if "0" not in row or "1" not in row:
            continue  # a --delays run of one side only (printed, not tabulated)
        m0, m1 = row["0"]["metric"], row["1"]["metric"]
        if gpt:
            gap, ok = f"{100 * (m1 - m0) / m0:+.1f} %", abs(m1 - m0) <= 0.03 * m0
        else:
            gap, ok = f"{m1 - m0:+.2f} pt", m1 >= m0 - 1.0
        fmt = "{:.3f}" if gpt else "{:.2f}"
        lines.append(f"| {name} | {fmt.format(m0)} | {fmt.format(m1)} | {gap} | "
                     f"{row['0']['tail_loss']:.3f} / {row['1']['tail_loss']:.3f} | "
                     f"{'met' if ok else 'MISSED'} |")
    return "\n".join(lines) + "\n"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("task", choices=("images", "gpt"))
    p.add_argument("--algorithms", default=ALGORITHMS)
    p.add_argument("--epochs", type=int, default=5, help="images")
    p.add_argument("--steps", type=int, default=500, help="gpt")
    p.add_argument("--batch", type=int, default=None, help="per rank (64 images, 16 gpt)")
    p.add_argument("--lr", type=float, default=None, help="0.05 SGD (images), 3e-3 AdamW (gpt)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (images)")
    p.add_argument("--nesterov", action="store_true", help="Nesterov momentum (images)")
    p.add_argument("--adamw", action="store_true", help="AdamW instead of SGD (images)")
    p.add_argument("--delays", default="0,1", help="which runs: 0, 1 or 0,1")
    p.add_argument("--no-predict", action="store_true",
                   help="delay=1 without weight prediction (plain one-step-stale SGD)")
    p.add_argument("--hidden", type=int, default=256, help="MLP width (images)")
    p.add_argument("--width", type=int, default=128, help="GPT width")
    p.add_argument("--layers", type=int, default=2, help="GPT blocks")
    p.add_argument("--block", type=int, default=64, help="GPT context")
    p.add_argument("--set", action="append", default=[], metavar="ALGO.FIELD=VALUE")
    p.add_argument("--timeout", type=float, default=1800.0, help="per algorithm (s)")
    p.add_argument("--seed", type=int, default=0,
                   help="model initialisation and data order (0: the published runs)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--resume", action="store_true", help="skip algorithms in --json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from hexagram.bench.cli import parse_settings
    from hexagram.launch import run_local

    a = _parse(sys.argv[1:] if argv is None else argv)
    gpt = a.task == "gpt"
    spec = {"task": a.task, "epochs": a.epochs, "steps": a.steps, "hidden": a.hidden,
            "batch": a.batch or (16 if gpt else 64), "lr": a.lr or (3e-3 if gpt else 0.05),
            "momentum": a.momentum, "nesterov": a.nesterov, "width": a.width,
            "layers": a.layers, "block": a.block, "predict": not a.no_predict, "adamw": a.adamw,
            "delays": [int(d) for d in a.delays.split(",")], "seed": a.seed,
            "config": parse_settings(a.set)}
    rows: dict[str, Any] = {}
    if a.resume and a.json and a.json.exists():
        rows = json.loads(a.json.read_text())["rows"]
    for name in a.algorithms.split(","):
        if name in rows:
            continue
        t0 = time.monotonic()
        rows[name] = _summary(spec, run_local(_worker, WORLD, args=(spec, name),
                                              timeout=a.timeout))
        metrics = " -> ".join(f"{rows[name][str(d)]['metric']:.3f}" for d in spec["delays"])
        print(f"{name}: {metrics} ({time.monotonic() - t0:.0f} s)", flush=True)
        if a.json:
            a.json.write_text(json.dumps({"spec": spec, "rows": rows}, indent=1))
    table = markdown(spec, rows)
    print(table)
    if a.markdown:
        a.markdown.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
