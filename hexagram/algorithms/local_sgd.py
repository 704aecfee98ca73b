"""Local SGD / post-local SGD: train locally, average weights every ``period`` steps.

After ``step()`` number ``s`` (counted from 1) of every optimizer, weights are averaged
over all ranks when ``s <= warmup_steps`` (post-local SGD's synchronous warm-up: one average
per step) or when ``(s - warmup_steps) % period == 0``. The average lands in the parameters
before ``step()`` returns, so every rank starts the next step from identical weights.

Local SGD *is* DiLoCo (:mod:`hexagram.algorithms.diloco`) with outer learning rate 1 and no
momentum: what is exchanged is the change since the last average, ``anchor - x_i``
(``anchor``: the weights all ranks agreed on last time), optionally compressed, and the new
weights are ``anchor - sum_i Q(anchor - x_i) / n``; in full precision the plain average of
the weights. Compressing the (small) change rather than the weights keeps 8-bit error small.
Only the schedule differs (the warm-up), so the exchange, the join protocol of uneven ends,
``synchronize()`` and checkpoints are DiLoCo's code.

Ranks that run out of data early (see :mod:`hexagram.algorithms.weight_sync`) flush their
last local steps in the next round and contribute nothing after that: ``n`` counts the ranks
that took a local step since the last round.

Example:
    >>> LocalSGDConfig(period=4, warmup_steps=10).period
    4
"""

from __future__ import annotations

from dataclasses import dataclass

from hexagram.algorithms.diloco import DiLoCoAlgorithm, DiLoCoConfig
from hexagram.algorithms.weight_sync import check_compressor_spec
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


class LocalSGDAlgorithm(DiLoCoAlgorithm):
    """Periodic model averaging: DiLoCo with ``outer_lr=1``, no momentum, and a warm-up."""

    name = "local_sgd"

    def __init__(self, config: LocalSGDConfig | None = None) -> None:
        cfg = config or LocalSGDConfig()
        super().__init__(DiLoCoConfig(period=cfg.period, outer_lr=1.0, outer_momentum=0.0,
                                      compressor=cfg.compressor))
        self.config = cfg

    def _due(self, step: int) -> bool:
        warmup = self.config.warmup_steps
        return step <= warmup or (step - warmup) % self.config.period == 0

    def _schedule(self) -> dict[str, int]:
        return {**super()._schedule(), "warmup_steps": self.config.warmup_steps}
