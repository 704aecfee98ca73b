"""Local SGD / post-local SGD: train locally, average weights every ``period`` steps.

After the first optimizer's ``step()`` number ``s`` (counted from 1), weights are averaged
over all ranks when ``s <= warmup_steps`` (post-local SGD's synchronous warm-up: one average
per step) or when ``(s - warmup_steps) % period == 0``. The average lands in the parameters
before ``step()`` returns, so every rank starts the next step from identical weights.

What is exchanged is the change since the last average, ``x_i - anchor`` (``anchor``: the
weights all ranks agreed on last time), optionally compressed; the new weights are
``anchor + sum_i Q(x_i - anchor) / n``. In full precision this equals the plain average of
the weights. Compressing the (small) change rather than the weights keeps 8-bit error small.

Ranks that run out of data early (see :mod:`hexagram.algorithms.weight_sync`) flush their
last local steps in the next round and contribute nothing after that: ``n`` counts the ranks
that took a local step since the last round.

Example:
    >>> LocalSGDConfig(period=4, warmup_steps=10).period
    4
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
from hexagram.compress.base import Compressor
from hexagram.config import check_int

__all__ = ["LocalSGDAlgorithm", "LocalSGDConfig"]


@dataclass(frozen=True, kw_only=True)
class LocalSGDConfig:
    """Config of :class:`LocalSGDAlgorithm`.

    Attributes:
        period: average every ``period`` steps (H); larger => ``period`` times less traffic,
            more divergence between replicas.
        warmup_steps: average after every one of the first ``warmup_steps`` steps (post-local
            SGD); more => closer to synchronous SGD early in training, more traffic.
        compressor: ``None`` (full precision) or a compressor name/instance applied to the
            change since the last average; fewer bits => fewer bytes, noisier average.
    """

    period: int = 8
    warmup_steps: int = 0
    compressor: str | Compressor | None = None

    def __post_init__(self) -> None:
        check_int(self, "period", low=1)
        check_int(self, "warmup_steps", low=0)
        check_compressor_spec(self, "compressor", allow_none=True)


class LocalSGDAlgorithm(RoundAlgorithm):
    """Periodic model averaging; see :class:`LocalSGDConfig`."""

    name = "local_sgd"

    def __init__(self, config: LocalSGDConfig | None = None) -> None:
        super().__init__(config or LocalSGDConfig())
        self.config: LocalSGDConfig
        self.compressor = as_compressor(self.config.compressor)

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        self._after_consensus()

    def _after_consensus(self) -> None:
        self.anchor = read_weights(self.ctx.buckets)

    def _on_step(self) -> None:
        s, cfg = self.step, self.config
        if s <= cfg.warmup_steps or (s - cfg.warmup_steps) % cfg.period == 0:
            self._round(active=True)

    def _round(self, active: bool) -> int:
        comm = self.ctx.comm
        self.rounds += 1
        flags = self._control(active, contributing=self.dirty).wait()
        n_active, n_contrib = int(flags[0].item()), int(flags[1].item())
        if n_contrib == 0:  # same decision on every rank: nobody has anything new
            return n_active
        weights = read_weights(self.ctx.buckets)
        changes = [w - a if self.dirty else (w - a).zero_() for w, a in zip(weights, self.anchor)]
        handles = [compressed_sum(comm, c, self.compressor) for c in changes]
        self.anchor = [a + h.wait() / n_contrib for a, h in zip(self.anchor, handles)]
        write_weights(self.ctx.buckets, self.anchor)
        self.dirty = False
        return n_active

    def state_dict(self) -> dict[str, Any]:
        state = self._base_state()
        state["anchor"] = named_from_flats(self.ctx.buckets, self.anchor)
        if self.compressor is not None:
            state["compressor"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base_state(state)
        self.anchor = flats_from_named(self.ctx.buckets, state["anchor"], "local_sgd anchor")
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])
