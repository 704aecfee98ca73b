"""ByzFL side by side: the same aggregators under the same attacks, ByzFL's code against
Hexagram's.

ByzFL (EPFL; ``byzfl==0.0.11``, the ``byzantine`` extra) simulates federated training in
one process. Its training framework (``byzfl.benchmark``) downloads its datasets through
torchvision and trains its own models, so a run of it would differ from ``hexagram train``
in everything but the aggregator. This script keeps ByzFL's **aggregators and attacks** and
drives them with ``hexagram train``'s set-up, in one process: the same MLP and
initialisation, the same per-rank shards (IID or Dirichlet) and batch order, SGD lr 0.05
momentum 0.9 on the aggregate. Each step computes every rank's gradient, the Byzantine rows
are replaced by the attack's vector, the aggregator reduces the ``(P, d)`` stack, and the
optimizer applies it. Two arms:

- ``byzfl``: ByzFL's attacks (``SignFlipping``: -mean of the honest gradients; ``IPM`` tau 2;
  ``ALIE`` tau 1.5; ``Gaussian`` N(0, 1); ``Inf`` for our ``nan``) and aggregators;
- ``hexagram``: Hexagram's attacks (:func:`hexagram.testing.attacks.corrupt`; ``sign_flip``
  is -own gradient, ``scale`` -10 x own, ``nan``) and aggregators
  (:mod:`hexagram.robust.aggregators`), i.e. ``hexagram train``'s arithmetic without the
  process group.

``label_flip`` is the same in both (gradients on flipped labels). ``--distributed JSON``
adds the accuracy of the real ``hexagram train`` run (``benchmarks/robust.py``'s JSON).

Example:
    $ PYTHONPATH=. python benchmarks/robust_byzfl.py --hosts 7 --byzantine 2 \\
        --json benchmarks/results/robust_byzfl7.json \\
        --distributed benchmarks/results/robust7_iid_a.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hexagram.bench.robust import training_shard
from hexagram.data import load
from hexagram.models import hidden_for_params, mlp
from hexagram.robust import aggregators as hx_agg
from hexagram.testing.attacks import byzantine_ranks, corrupt

AGGREGATORS = ("average", "trimmed_mean", "median", "krum", "multikrum", "geomed",
               "centered_clip")
ATTACKS = ("none", "sign_flip", "scale", "alie", "ipm", "gaussian", "label_flip", "nan")
Aggregate = Callable[[Tensor], Tensor]


def byzfl_modules() -> tuple[Any, Any]:
    """``byzfl.aggregators.aggregators`` and ``byzfl.attacks.attacks`` without the package
    ``__init__`` (which imports torchvision for its dataset loaders)."""
    if "byzfl" not in sys.modules:
        spec = importlib.util.find_spec("byzfl")
        if spec is None or spec.origin is None:
            raise SystemExit("byzfl is not installed: pip install 'hexagram[byzantine]'")
        pkg = types.ModuleType("byzfl")
        pkg.__path__ = [os.path.dirname(spec.origin)]
        sys.modules["byzfl"] = pkg
    from byzfl.aggregators import aggregators
    from byzfl.attacks import attacks

    return aggregators, attacks


def aggregator(arm: str, name: str, f: int) -> Aggregate:
    """A fresh aggregator (centered clipping keeps its center between calls)."""
    if arm == "byzfl":
        a, _ = byzfl_modules()
        make = {"average": a.Average, "trimmed_mean": lambda: a.TrMean(f=f),
                "median": a.Median, "krum": lambda: a.Krum(f=f),
                "multikrum": lambda: a.MultiKrum(f=f),
                "geomed": lambda: a.GeometricMedian(nu=0.1, T=3),
                "centered_clip": lambda: a.CenteredClipping(tau=1.0, L=1)}[name]
        fn = make()
        return lambda x: torch.as_tensor(fn(x.clone()), dtype=x.dtype)
    if name == "centered_clip":
        center: list[Tensor | None] = [None]

        def clip(x: Tensor) -> Tensor:
            center[0] = hx_agg.centered_clip(x, tau=1.0, iters=1, center=center[0])
            return center[0]
        return clip
    plain: dict[str, Aggregate] = {
        "average": lambda x: x.mean(dim=0), "median": hx_agg.median,
        "trimmed_mean": lambda x: hx_agg.trimmed_mean(x, f), "geomed": hx_agg.geomed,
        "krum": lambda x: hx_agg.krum(x, f), "multikrum": lambda x: hx_agg.multikrum(x, f)}
    return plain[name]


def attack_rows(arm: str, name: str, grads: Tensor, byz: tuple[int, ...],
                gen: torch.Generator) -> Tensor | None:
    """The Byzantine rows ``(f, d)``, or None when this arm has no such attack."""
    honest = grads[[r for r in range(grads.shape[0]) if r not in byz]]
    if name in ("none", "label_flip"):
        return grads[list(byz)]
    if arm == "hexagram":
        return torch.stack([corrupt(name, grads[r], honest, generator=gen) for r in byz])
    _, k = byzfl_modules()
    make = {"sign_flip": k.SignFlipping, "alie": k.ALittleIsEnough,
            "ipm": k.InnerProductManipulation, "gaussian": k.Gaussian, "nan": k.Inf}
    if name not in make:
        return None  # ByzFL has no "scale" attack
    if name == "gaussian":  # one draw per Byzantine rank, as Hexagram's (global RNG)
        draw = k.Gaussian(mu=0.0, sigma=1.0)
        return torch.stack([torch.as_tensor(draw(honest), dtype=grads.dtype) for _ in byz])
    bad = torch.as_tensor(make[name]()(honest.clone()), dtype=grads.dtype)
    return bad.expand(len(byz), -1)


class Sim:
    """``hexagram train``'s image task for ``world`` ranks in one process."""

    def __init__(self, opts: argparse.Namespace, attack: str) -> None:
        self.data = load("fashion-mnist")
        side = self.data.x_train.shape[-1]
        torch.manual_seed(opts.seed)  # as trainloop: the same initial weights
        hidden = hidden_for_params(opts.params, side * side, 2, self.data.classes)
        self.model: nn.Module = mlp(side * side, hidden, 2, self.data.classes)
        self.byz = byzantine_ranks(0 if attack == "none" else opts.byzantine, opts.hosts)
        spec = {"partition": opts.partition, "alpha": opts.alpha, "seed": opts.seed,
                "byzantine": len(self.byz), "attack": attack}
        self.shards = [training_shard(spec, self.data.x_train, self.data.y_train,
                                      self.data.classes, r, opts.hosts)
                       for r in range(opts.hosts)]
        self.opts = opts

    def batches(self, epoch: int, rank: int) -> list[tuple[Tensor, Tensor]]:
        """Rank ``rank``'s batches of ``epoch``, in trainloop's order."""
        x, y = self.shards[rank]
        g = torch.Generator().manual_seed(self.opts.seed * 1000 + epoch * 97 + rank)
        perm = torch.randperm(len(y), generator=g)
        b = self.opts.batch
        return [(x[perm[i:i + b]], y[perm[i:i + b]]) for i in range(0, len(y) - b + 1, b)]

    def grads(self, batch: list[tuple[Tensor, Tensor]]) -> Tensor:
        """``(P, d)``: every rank's flat gradient on its batch."""
        rows = []
        for x, y in batch:
            self.model.zero_grad()
            F.cross_entropy(self.model(x), y).backward()
            rows.append(torch.cat([p.grad.reshape(-1) for p in self.model.parameters()
                                   if p.grad is not None]))
        return torch.stack(rows)

    @torch.no_grad()
    def accuracy(self) -> float:
        self.model.eval()
        d = self.data
        correct = sum(int((self.model(xb).argmax(1) == yb).sum())
                      for xb, yb in zip(d.x_test.split(2000), d.y_test.split(2000)))
        self.model.train()
        return correct / len(d.y_test)


def train(opts: argparse.Namespace, arm: str, agg_name: str, attack: str) -> dict[str, Any]:
    """One run; ``{"final": ..., "curve": ...}`` or ``{"error": ...}``."""
    sim = Sim(opts, attack)
    f = max(1, opts.byzantine)
    reduce = aggregator(arm, agg_name, f)
    gen = torch.Generator().manual_seed(opts.seed)
    torch.manual_seed(opts.seed + 1)  # ByzFL's Gaussian draws from the global RNG
    opt = torch.optim.SGD(sim.model.parameters(), lr=opts.lr, momentum=0.9)
    params = list(sim.model.parameters())
    curve = []
    for epoch in range(opts.epochs):
        per_rank = [sim.batches(epoch, r) for r in range(opts.hosts)]
        for step, batch in enumerate(zip(*per_rank), start=1):
            g = sim.grads(list(batch))
            if sim.byz:
                bad = attack_rows(arm, attack, g, sim.byz, gen)
                if bad is None:
                    return {"error": f"{arm} has no {attack!r} attack"}
                g[list(sim.byz)] = bad
            out = reduce(g)
            _set_grads(params, out)
            opt.step()
            if step == len(per_rank[0]) // 2 or step == len(per_rank[0]):
                curve.append({"epoch": epoch + step / len(per_rank[0]),
                              "metric": sim.accuracy()})
    return {"final": curve[-1]["metric"], "curve": curve}


def _set_grads(params: list[nn.Parameter], flat: Tensor) -> None:
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def distributed_finals(paths: list[str]) -> dict[tuple[str, str], float]:
    """(attack, aggregator) -> final accuracy of real ``hexagram train`` runs."""
    out: dict[tuple[str, str], float] = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                name = r["algorithm"]
                agg = "average" if name == "allreduce" else name.removeprefix(
                    "robust:aggregator=")
                if "final" in r:
                    out[(r["attack"], agg)] = r["final"]
    return out


def markdown(rows: list[dict[str, Any]], real: dict[tuple[str, str], float]) -> str:
    """Rows: aggregators; columns: attacks; cells ``byzfl / hexagram [/ process group]``."""
    attacks = list(dict.fromkeys(r["attack"] for r in rows))
    aggs = list(dict.fromkeys(r["aggregator"] for r in rows))
    cell = {(r["arm"], r["attack"], r["aggregator"]): r for r in rows}

    def pct(r: dict[str, Any] | None) -> str:
        return "-" if r is None or "final" not in r else f"{100 * r['final']:.1f}"

    lines = ["| aggregator | " + " | ".join(attacks) + " |", "|---" * (len(attacks) + 1) + "|"]
    for a in aggs:
        vals = []
        for t in attacks:
            v = f"{pct(cell.get(('byzfl', t, a)))} / {pct(cell.get(('hexagram', t, a)))}"
            if (t, a) in real:
                v += f" / {100 * real[(t, a)]:.1f}"
            vals.append(v)
        lines.append(f"| {a} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--hosts", type=int, default=7)
    a("--byzantine", type=int, default=2)
    a("--partition", choices=("iid", "dirichlet"), default="iid")
    a("--alpha", type=float, default=0.3)
    a("--aggregators", default=",".join(AGGREGATORS))
    a("--attacks", default=",".join(ATTACKS))
    a("--arms", default="byzfl,hexagram")
    a("--epochs", type=int, default=1)
    a("--params", type=int, default=100_000)
    a("--batch", type=int, default=64)
    a("--lr", type=float, default=0.05)
    a("--seed", type=int, default=0)
    a("--json", required=True)
    a("--distributed", action="append", default=[], metavar="JSON",
      help="benchmarks/robust.py results of the same set-up (a third number per cell)")
    a("--markdown")
    opts = p.parse_args(argv)
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for attack in opts.attacks.split(","):
        for agg in opts.aggregators.split(","):
            for arm in opts.arms.split(","):
                r = train(opts, arm, agg, attack)
                rows.append({"arm": arm, "attack": attack, "aggregator": agg, **r})
                print(f"{arm:8s} {attack:10s} {agg:14s} {r.get('final', r.get('error'))}",
                      file=sys.stderr, flush=True)
                with open(opts.json, "w") as f:
                    json.dump({"settings": vars(opts), "rows": rows}, f, indent=1)
    text = markdown(rows, distributed_finals(opts.distributed))
    print(text)
    if opts.markdown:
        with open(opts.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
