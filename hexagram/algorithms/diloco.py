"""DiLoCo and streaming DiLoCo: inner optimizer for H steps, outer Nesterov on the average.

DiLoCo (Douillard et al. 2023): every rank runs the wrapped (inner) optimizer, e.g. AdamW,
for ``period`` steps from the shared weights ``anchor``; then the pseudo-gradient
``delta_i = anchor - x_i`` is averaged over ranks (optionally compressed, e.g. 8-bit) and an
outer SGD step with Nesterov momentum updates the shared weights::

    d = sum_i Q(delta_i) / n          # n: ranks that stepped since the last sync
    m = outer_momentum * m + d
    anchor = anchor - outer_lr * (d + outer_momentum * m)
    x_i = anchor                      # every rank restarts from the new shared weights

The outer step runs in ``after_step`` (after the first optimizer's ``step()`` number
``k * period``), so the next forward pass uses the new shared weights.

Streaming DiLoCo (2025) with ``fragments = F > 1``: the tensors are split into F contiguous
fragments of similar size; fragment ``r mod F`` is synchronised (same formula, its own
momentum) every ``period / F`` steps, so each fragment is still synchronised every
``period`` steps but traffic is spread evenly instead of arriving in bursts.

Example:
    >>> DiLoCoConfig(period=50, fragments=5).outer_lr
    0.7
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hexagram.algorithms.base import AlgorithmContext
from hexagram.algorithms.weight_sync import (
    RoundAlgorithm,
    as_compressor,
    check_compressor_spec,
    compressed_sum,
    flats_from_named,
    named_from_flats,
    read_weights,
    write_weights,
)
from hexagram.buckets import Bucket
from hexagram.compress.base import Compressor
from hexagram.config import check_float, check_int
from hexagram.errors import ConfigError

__all__ = ["DiLoCoAlgorithm", "DiLoCoConfig"]


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    """Config of :class:`DiLoCoAlgorithm`.

    Attributes:
        period: inner steps between synchronisations of a fragment (H); larger => less
            traffic, more drift.
        outer_lr: outer learning rate; larger => bigger moves of the shared weights (1.0
            without momentum is plain model averaging).
        outer_momentum: Nesterov momentum of the outer step in [0, 1); larger => smoother.
        compressor: ``None`` or a compressor name/instance for the pseudo-gradients (e.g.
            8-bit ``"minmax8"``); fewer bits => fewer bytes, noisier outer step.
        fragments: streaming DiLoCo's number of fragments; 1 => plain DiLoCo; more =>
            smaller, more frequent messages. ``period`` must be a multiple of it.
    """

    period: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compressor: str | Compressor | None = None
    fragments: int = 1

    def __post_init__(self) -> None:
        check_int(self, "period", low=1)
        check_float(self, "outer_lr", low=0.0, low_open=True)
        check_float(self, "outer_momentum", low=0.0, high=1.0, high_open=True)
        check_compressor_spec(self, "compressor", allow_none=True)
        check_int(self, "fragments", low=1)
        if self.period % self.fragments:
            raise ConfigError(f"DiLoCoConfig.period ({self.period}) must be a multiple of "
                              f"DiLoCoConfig.fragments ({self.fragments})")


def _split(buckets: list[Bucket], parts: int) -> list[list[Bucket]]:
    """The tensors of ``buckets`` in ``parts`` contiguous groups of similar size."""
    if parts == 1:
        return [buckets]
    named = [(e.name, e.param) for b in buckets for e in b.entries]
    if len(named) < parts:
        raise ConfigError(f"DiLoCoConfig.fragments={parts} but the model has only "
                          f"{len(named)} trainable tensors; use fragments <= {len(named)}")
    total, size = sum(p.numel() for _, p in named), 0
    groups: list[list[tuple[str, torch.nn.Parameter]]] = []
    current: list[tuple[str, torch.nn.Parameter]] = []
    for i, (name, p) in enumerate(named):
        current.append((name, p))
        size += p.numel()
        left_tensors, left_groups = len(named) - i - 1, parts - len(groups) - 1
        if left_groups > 0 and (size * parts >= total * (len(groups) + 1)
                                or left_tensors == left_groups):
            groups.append(current)
            current = []
    groups.append(current)
    return [[Bucket(0, g)] for g in groups]


class DiLoCoAlgorithm(RoundAlgorithm):
    """Inner steps locally, outer Nesterov step on averaged pseudo-gradients."""

    name = "diloco"

    def __init__(self, config: DiLoCoConfig | None = None) -> None:
        super().__init__(config or DiLoCoConfig())
        self.config: DiLoCoConfig
        self.compressor = as_compressor(self.config.compressor)

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        self.fragments = _split(ctx.buckets, self.config.fragments)
        self.momentum = [[torch.zeros_like(b.flat) for b in f] for f in self.fragments]
        self.fresh = [False] * len(self.fragments)  # local steps since the fragment's sync
        self._after_consensus()

    def _after_consensus(self) -> None:
        self.anchor = [read_weights(f) for f in self.fragments]
        self.fresh = [False] * len(self.fragments)

    def _on_step(self) -> None:
        self.fresh = [True] * len(self.fragments)
        if self.step % (self.config.period // self.config.fragments) == 0:
            self._round(active=True)

    def _round(self, active: bool) -> int:
        f = self.rounds % len(self.fragments)
        self.rounds += 1
        flags = self._control(active, contributing=self.fresh[f]).wait()
        n_active, n_contrib = int(flags[0].item()), int(flags[1].item())
        if n_contrib > 0:  # identical decision everywhere
            self._outer_step(f, n_contrib)
        return n_active

    def _outer_step(self, f: int, n: int) -> None:
        buckets, anchor = self.fragments[f], self.anchor[f]
        local = read_weights(buckets)
        deltas = [a - x if self.fresh[f] else torch.zeros_like(x) for a, x in zip(anchor, local)]
        handles = [compressed_sum(self.ctx.comm, d, self.compressor) for d in deltas]
        mu, lr = self.config.outer_momentum, self.config.outer_lr
        for a, m, h in zip(anchor, self.momentum[f], handles):
            d = h.wait() / n
            m.mul_(mu).add_(d)
            a.sub_(lr * (d + mu * m))
        write_weights(buckets, anchor)
        self.fresh[f] = False

    def state_dict(self) -> dict[str, Any]:
        state = self._base_state()
        state["fresh"] = list(self.fresh)
        state["anchor"], state["outer_momentum"] = {}, {}
        for f, buckets in enumerate(self.fragments):
            state["anchor"].update(named_from_flats(buckets, self.anchor[f]))
            state["outer_momentum"].update(named_from_flats(buckets, self.momentum[f]))
        if self.compressor is not None:
            state["compressor"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base_state(state)
        self.fresh = [bool(x) for x in state["fresh"]]
        self.anchor = [flats_from_named(b, state["anchor"], "diloco anchor")
                       for b in self.fragments]
        self.momentum = [flats_from_named(b, state["outer_momentum"], "diloco momentum")
                         for b in self.fragments]
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])
