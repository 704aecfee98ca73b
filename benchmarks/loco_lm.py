"""Past DiLoCo on a language model: validation loss against steps and bytes sent per rank.

A GPT (:mod:`hexagram.models.gpt`, about 3.2M parameters at the default width) on the
bundled character corpus (:mod:`hexagram.data.text`), 4 ranks on loopback (gloo), the
same initial weights, data order, batch and step budget for every method:

- ``ddp``: allreduce every step, AdamW;
- ``diloco-H=10``, ``diloco-H=50``, ``diloco-H=100``: AdamW inner, outer Nesterov (lr 0.7,
  momentum 0.9);
- ``streaming-4bit``: DiLoCo H=50 in 5 fragments, one inner step of overlap, 4-bit
  (``minmax4``) outer gradients;
- ``sparseloco``: H=50, the paper's defaults (chunks of 4096, 1.56 %, 2 bits, beta 0.95);
  ``sparseloco-H=10``: the same, syncing every 10 steps;
- ``demo`` (the paper's chunk 64, top-k 32) and ``demo-k2`` (top-2 of 64) on the user's SGD
  (momentum 0.9, taken over), and ``ddp-sgd``: the allreduce baseline with that same SGD
  (DeMo cannot run on AdamW).

Validation loss is the mean over ranks of each rank's current model on fixed validation
windows (between syncs the replicas differ), and at the end on the shared weights after
``synchronize()``. Bytes are each rank's ``bytes_sent()`` (what it put on the wire) before
that final full-precision average of the weight algorithms (reported apart as
``final_sync_bytes``: one model's allreduce, the same for each of them).
The network lab at 10 Mbit/s (time to a target loss) is :mod:`loco_lab`; the table over
seeds is :mod:`loco_table`.

Example (the reduced run of docs/benchmarks/loco.md):
    $ python benchmarks/loco_lm.py --width 128 --layers 4 --batch 8 --steps 200 \\
        --eval-every 50 --seeds 0 --json loco_lm.json
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

METHODS: dict[str, tuple[str, dict[str, Any], str]] = {
    "ddp": ("allreduce", {}, "adamw"),
    "diloco-H=10": ("diloco", {"period": 10}, "adamw"),
    "diloco-H=50": ("diloco", {"period": 50}, "adamw"),
    "diloco-H=100": ("diloco", {"period": 100}, "adamw"),
    "streaming-4bit": ("diloco", {"period": 50, "fragments": 5, "overlap_steps": 1,
                                  "compressor": "minmax4"}, "adamw"),
    "sparseloco": ("sparseloco", {"period": 50}, "adamw"),
    "sparseloco-H=10": ("sparseloco", {"period": 10}, "adamw"),
    "ddp-sgd": ("allreduce", {}, "sgd"),
    "demo": ("decoupled_momentum", {}, "sgd"),
    "demo-k2": ("decoupled_momentum", {"k": 2}, "sgd"),
}


def _optimizer(kind: str, model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.sgd_lr, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)


def _val_loss(model: nn.Module, windows: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        logits = model(windows[0])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), windows[1].flatten())
    total = loss.detach().reshape(1).clone()
    dist.all_reduce(total)  # mean over the ranks' current models
    return float(total) / dist.get_world_size()


def make_model(opt_kind: str, seed: int, args: argparse.Namespace
               ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The GPT of ``args`` with ``seed``'s initial weights, and its optimizer."""
    from hexagram.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    net = GPT(GPTConfig(block_size=args.block, n_layer=args.layers, n_head=4,
                        n_embd=args.width))
    return net, _optimizer(opt_kind, net, args)


def _run(method: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    import hexagram as hx
    from hexagram.data.text import load_text

    algo, config, opt_kind = METHODS[method]
    corpus = load_text()
    net, opt = make_model(opt_kind, seed, args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DeMo's takeover notice
        model = hx.DistributedDataParallel(net, optimizers=[opt],
                                           algorithm=hx.algorithms.get(algo, **config))
    val = corpus.batch("valid", 32, args.block, torch.Generator().manual_seed(12345))
    gen = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    curve, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = corpus.batch("train", args.batch, args.block, gen)
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
        if step % args.eval_every == 0 and step < args.steps:
            curve.append({"step": step, "val": _val_loss(net, val),
                          "bytes": model.bytes_sent()})
    sent = model.bytes_sent()  # the method's own traffic, before the final average
    model.synchronize()
    curve.append({"step": args.steps, "val": _val_loss(net, val), "bytes": sent,
                  "final_sync_bytes": model.bytes_sent() - sent})
    seconds = time.perf_counter() - start
    model.close()
    return {"method": method, "seed": seed, "params": sum(p.numel() for p in net.parameters()),
            "curve": curve, "seconds": seconds}


def _worker(methods: list[str], seeds: list[int], args: argparse.Namespace
            ) -> list[dict[str, Any]]:
    import hexagram as hx

    torch.set_num_threads(1)
    hx.init(timeout=600)
    out = []
    for s in seeds:
        for m in methods:
            out.append(_run(m, s, args))
            if dist.get_rank() == 0:  # progress, flushed: long runs are otherwise silent
                print(f"done {m} seed {s}: {out[-1]['curve'][-1]} in "
                      f"{out[-1]['seconds']:.0f} s", flush=True)
    return out


def model_arguments(p: argparse.ArgumentParser) -> None:
    """The model, batch, optimizers and ranks: the same flags here and in ``loco_lab``."""
    p.add_argument("--batch", type=int, default=8, help="windows per rank and step")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    p.add_argument("--sgd-lr", type=float, default=0.1, help="SGD's (ddp-sgd, demo)")
    p.add_argument("--world", type=int, default=4)


def main() -> None:
    from hexagram.launch import run_local

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=100)
    model_arguments(p)
    p.add_argument("--json", default="")
    args = p.parse_args()
    methods, seeds = args.methods.split(","), [int(s) for s in args.seeds.split(",")]
    results = run_local(_worker, args.world, args=(methods, seeds, args), timeout=86_400)[0]
    print(f"{'method':>15} {'seed':>4} {'final val':>9} {'MB sent/rank':>12} {'s':>6}")
    for r in results:
        last = r["curve"][-1]
        print(f"{r['method']:>15} {r['seed']:>4} {last['val']:9.4f} "
              f"{last['bytes'] / 1e6:12.4f} {r['seconds']:6.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
