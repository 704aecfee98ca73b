"""Robustness benchmark glue for ``hexagram train``: options, data split, attacked wrapping.

``hexagram train --byzantine F --attack A [--partition dirichlet --alpha 0.3]`` makes the
last ``F`` ranks Byzantine: they train on flipped labels (``label_flip``) or send
:func:`hexagram.testing.attacks.corrupt`'s vector instead of their gradient (every other
attack), through :class:`~hexagram.testing.attacks.AttackedAlgorithm`, so no algorithm's
code changes. An algorithm whose ranks send something other than the gradient (``robust``
sends its worker momentum: ``outgoing``/``send``) is attacked on what it sends
(:class:`SentAttacked`), the papers' threat model: the attacker replaces the vector on the
wire, and the omniscient ones see the honest ranks' vectors.
``--partition dirichlet`` gives each rank a non-IID share of the training set:
for every class, the fractions going to the ranks are drawn from ``Dirichlet(alpha)``
(smaller alpha => more skewed); every rank gets the same number of samples per epoch (its
share, cycled) so all ranks run the same number of steps.

Example:
    >>> import torch
    >>> y = torch.arange(10).repeat(20)
    >>> parts = [dirichlet_indices(y, r, 4, alpha=0.3, seed=0) for r in range(4)]
    >>> sorted(torch.cat(parts).tolist()) == list(range(200))
    True
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from hexagram.buckets import Bucket
from hexagram.comm.communicator import Handle
from hexagram.testing.attacks import (
    ATTACKS,
    OMNISCIENT,
    AttackConfig,
    AttackedAlgorithm,
    byzantine_ranks,
    check_attack,
    corrupt,
    flip_labels,
)

__all__ = ["SentAttacked", "add_arguments", "attacked_wrap", "dirichlet_indices", "rank_outcomes",
           "report_failed_step", "spec_fields", "training_shard"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The robustness options of ``hexagram train``."""
    a = parser.add_argument
    a("--byzantine", type=int, default=0,
      help="number of Byzantine ranks (the last ones); 0: no attack")
    a("--attack", default="sign_flip", help=f"what they send: {', '.join(ATTACKS)}")
    a("--partition", choices=("iid", "dirichlet"), default="iid",
      help="training split across ranks: interleaved (iid) or Dirichlet non-IID")
    a("--alpha", type=float, default=0.3, help="Dirichlet concentration (smaller: more skew)")


def spec_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The worker spec's robustness fields (checked here, before any rank starts)."""
    check_attack(args.attack)
    if args.byzantine < 0:
        raise SystemExit(f"--byzantine {args.byzantine}: must be >= 0")
    return {"byzantine": args.byzantine, "attack": args.attack, "partition": args.partition,
            "alpha": args.alpha}


def dirichlet_indices(y: Tensor, rank: int, world: int, alpha: float, seed: int = 0) -> Tensor:
    """Indices of rank ``rank``'s Dirichlet share of labels ``y`` (the same draw on every
    rank, so the shares partition the data)."""
    if alpha <= 0:
        raise ValueError(f"Dirichlet alpha must be > 0, got {alpha}")
    rng = np.random.default_rng(seed)  # numpy: no global torch RNG touched
    mine = []
    for c in torch.unique(y).tolist():
        idx = (y == c).nonzero().squeeze(1)
        idx = idx[torch.from_numpy(rng.permutation(len(idx)))]
        cuts = (np.cumsum(rng.dirichlet([alpha] * world)) * len(idx)).round().astype(int)
        start = 0 if rank == 0 else int(cuts[rank - 1])
        mine.append(idx[start:int(cuts[rank]) if rank < world - 1 else len(idx)])
    return torch.cat(mine)


def training_shard(spec: dict[str, Any], x: Tensor, y: Tensor, classes: int, rank: int,
                   world: int) -> tuple[Tensor, Tensor]:
    """This rank's training data: IID (interleaved) or Dirichlet, labels flipped on the
    Byzantine ranks under ``label_flip``."""
    if spec.get("partition", "iid") == "dirichlet":
        own = dirichlet_indices(y, rank, world, spec.get("alpha", 0.3), spec.get("seed", 0))
        g = torch.Generator().manual_seed(spec.get("seed", 0) + rank)
        own = own[torch.randperm(len(own), generator=g)]
        per_rank = len(y) // world  # same steps everywhere: cycle a small share
        pick = own[torch.arange(per_rank) % max(1, len(own))]
        xs, ys = x[pick], y[pick]
    else:
        xs, ys = x[rank::world], y[rank::world]
    byz = byzantine_ranks(spec.get("byzantine", 0), world)
    if spec.get("attack") == "label_flip" and rank in byz:
        ys = flip_labels(ys, classes)
    return xs, ys


def attacked_wrap(spec: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer,
                  world: int) -> Any:
    """Like :func:`hexagram.bench.peers.wrap` for a Hexagram algorithm, with the attack."""
    import hexagram as hx
    from hexagram.bench.peers import Wrapped, is_peer

    name = spec["algorithm"]
    if is_peer(name):
        raise ValueError(f"--byzantine needs a Hexagram algorithm; {name!r} is PyTorch DDP "
                         "(use 'allreduce', its equivalent)")
    inner = hx.algorithms.get(name, **dict(spec.get("config") or {}))
    attack = AttackConfig(name=spec["attack"], ranks=byzantine_ranks(spec["byzantine"], world),
                          seed=spec.get("seed", 0))
    algorithm = SentAttacked(inner, attack)
    mb = spec.get("bucket_mb")
    kwargs = {} if mb is None else {"bucket_size_mb": mb, "first_bucket_mb": min(1.0, mb)}
    ddp = hx.DistributedDataParallel(module, optimizers=[optimizer], algorithm=algorithm, **kwargs)
    report_failed_step(optimizer, hx.get_runtime().rank)
    return Wrapped(ddp, lambda: None, ddp.bytes_sent, estimated=False, close=ddp.close,
                   in_backward=True)


#: how the line :func:`report_failed_step` prints begins (the harness reads it in the log)
FAILED_STEP = "hexagram-bench: failed at step"


def report_failed_step(optimizer: torch.optim.Optimizer, rank: int) -> None:
    """Print ``FAILED_STEP <n> on rank <r>: <error class>`` to stderr when
    ``optimizer.step()`` raises (the step checks raise there: a peer's malformed or
    non-finite contribution), then re-raise: every rank's log then says at which step it
    failed, whether or not the error's message names it (:func:`rank_outcomes`)."""
    original = optimizer.step
    done = [0]  # optimizer steps completed: the failing one's index

    def step(*args: Any, **kwargs: Any) -> Any:
        try:
            out = original(*args, **kwargs)
        except Exception as exc:
            print(f"{FAILED_STEP} {done[0]} on rank {rank}: {type(exc).__name__}",
                  file=sys.stderr, flush=True)
            raise
        done[0] += 1
        return out

    optimizer.step = step  # type: ignore[method-assign]


class SentAttacked(AttackedAlgorithm):
    """:class:`~hexagram.testing.attacks.AttackedAlgorithm` that corrupts the vector the
    inner algorithm *sends* when it exposes ``outgoing(bucket)`` and ``send(bucket, vec)``
    (``robust`` with worker momentum sends its momentum; corrupting the gradient before it
    would let the attacker's own momentum average the attack away); otherwise the same.

    Example:
        >>> import hexagram as hx
        >>> a = SentAttacked(hx.algorithms.get("robust"), AttackConfig(name="scale", ranks=(1,)))
        >>> a.inner.name
        'robust'
    """

    def bucket_ready(self, bucket: Bucket) -> Handle[Tensor] | None:
        inner: Any = self.inner
        if not (hasattr(inner, "outgoing") and hasattr(inner, "send")):
            return super().bucket_ready(bucket)
        vec = inner.outgoing(bucket)  # every rank: the omniscient ones gather honest vectors
        a = self.attack
        honest = self._honest(vec) if a.name in OMNISCIENT else None
        if self.ctx.comm.rank in a.ranks and not self.corrupting:  # (bytes: on encoding)
            vec = corrupt(a.name, vec, honest, scale=a.scale, sigma=a.sigma, tau=a.tau,
                          generator=self._generator)  # a new tensor: its momentum stays
        return inner.send(bucket, vec)


def rank_outcomes(ranks: list[dict[str, Any]], codes: list[int | None],
                  logs: list[str] | None = None) -> list[dict[str, Any]]:
    """Every rank's outcome of one run (not only the first error): its exit code (None: it
    missed the deadline), and where it failed the error's class, the step (from the
    :data:`FAILED_STEP` line of its log ``logs[rank]``, else the ``step N`` its message
    names, else None) and the message's first line.

    Example:
        >>> rank_outcomes([{"rank": 0, "error": "MalformedPayloadError: rank 4 sent ..."},
        ...                {"rank": 1, "metric": 0.9}], [3, 0],
        ...               [f"{FAILED_STEP} 0 on rank 0: MalformedPayloadError", ""])[0]
        {'rank': 0, 'exit': 3, 'error_class': 'MalformedPayloadError', 'step': 0, \
'error': 'MalformedPayloadError: rank 4 sent ...'}
    """
    import re

    by_rank = {int(r["rank"]): r for r in ranks}
    out: list[dict[str, Any]] = []
    for rank, code in enumerate(codes):
        r = by_rank.get(rank)
        row: dict[str, Any] = {"rank": rank, "exit": code}
        if r is None:
            row["error"] = "wrote no result"
        elif "error" in r:
            text = str(r["error"])
            log = logs[rank] if logs is not None and rank < len(logs) else ""
            step = re.search(re.escape(FAILED_STEP) + r" (\d+)", log) \
                or re.search(r"\bstep (\d+)", text)
            row.update(error_class=text.split(":", 1)[0].strip(),
                       step=None if step is None else int(step.group(1)),
                       error=text.splitlines()[0][:300])
        out.append(row)
    return out
