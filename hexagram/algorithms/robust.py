"""Byzantine-robust gradient aggregation over a real process group.

Every rank's gradient bucket is split into P shards; an all-to-all hands rank ``j`` shard
``j`` of every rank; rank ``j`` aggregates its ``(P, m)`` rows robustly and an allgather
returns the full aggregate to everyone (:func:`hexagram.comm.shards.shard_map`): about
``2 d`` bytes sent per rank, like a ring allreduce, not ``P d``. Coordinate-wise aggregators
(median, trimmed mean) need nothing more; distance-based ones (Krum, Multi-Krum, geometric
median, centered clipping) and pre-aggregation (NNM, bucketing) add one allreduce of the
``P x P`` Gram matrix summed from the shards. Rows with NaN/Inf are treated as Byzantine.

The aggregate replaces the mean, so the result is on the scale of one gradient. Centered
clipping starts from the previous aggregate (its "history", Karimireddy et al. 2021);
optional worker momentum (``momentum``) is applied before sending, as that paper
recommends with plain SGD. With ``compressor``
both legs carry compressed payloads, decoded before aggregation (no error feedback).

Example:
    >>> import hexagram as hx
    >>> algo = hx.algorithms.get("robust", aggregator="krum", f=1)
    >>> algo.config.aggregator, algo.config.f
    ('krum', 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hexagram import compress
from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.buckets import Bucket
from hexagram.comm.communicator import Handle
from hexagram.comm.shards import ShardInfo, shard_map
from hexagram.compress.base import Compressor
from hexagram.config import check_float
from hexagram.errors import ConfigError
from hexagram.robust.shard_reduce import AGGREGATORS, ReduceSpec, reduce_rows

__all__ = ["AGGREGATORS", "RobustAlgorithm", "RobustConfig"]

@dataclass(frozen=True, kw_only=True)
class RobustConfig(ReduceSpec):
    """Config of :class:`RobustAlgorithm`: the aggregation fields of
    :class:`~hexagram.robust.shard_reduce.ReduceSpec` (``aggregator``, ``f``, ``pre``,
    ``bucket_size``, ``iters``, ``nu``, ``tau``, ``clip_iters``, defined and checked there
    once) plus what the algorithm adds around the reduction.

    Attributes:
        momentum: worker momentum applied before sending, ``m = beta m + (1 - beta) g``
            (higher => less variance for the aggregator to confuse with attacks, more lag).
            Karimireddy et al. (2021) pair it with plain SGD on the update; on top of an
            optimizer that has momentum already (SGD momentum 0.9, Adam) the two filters
            compound and training can diverge, so the default is 0 (drop-in).
        compressor: compress both legs with this registered compressor (e.g. ``"minmax8"``,
            ``"topk"``), or None for full precision.
        seed: bucketing's shared permutations and the compressor's noise.

    Example:
        >>> RobustConfig(aggregator="median", f=2, momentum=0.9).pre is None
        True
    """

    momentum: float = 0.0
    compressor: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compressor is not None and self.compressor not in compress.names():
            raise ConfigError(f"RobustConfig.compressor {self.compressor!r} is unknown; valid: "
                              f"None, {', '.join(compress.names())}")
        check_float(self, "momentum", low=0.0, high=1.0, high_open=True)


class RobustAlgorithm(Algorithm):
    """Robust gradient aggregation by shards; see :class:`RobustConfig`."""

    name = "robust"
    kind = "grad"

    def __init__(self, config: RobustConfig | None = None) -> None:
        super().__init__(config or RobustConfig())
        self.config: RobustConfig
        c = self.config
        self.compressor: Compressor | None = (
            None if c.compressor is None else compress.get(c.compressor))
        self.momenta: dict[int, Tensor] = {}   # bucket index -> worker momentum (flat)
        self.centers: dict[int, Tensor] = {}   # bucket index -> previous aggregate (flat)
        self.calls = 0                          # buckets reduced: seeds bucketing's draws
        self.generator = torch.Generator()
        self.reduce_generator = torch.Generator()  # second leg, on the issuing thread

    def setup(self, ctx: AlgorithmContext) -> None:
        self.config.check_world_size(ctx.comm.size)
        super().setup(ctx)
        self.generator = torch.Generator(device=ctx.runtime.device)
        self.generator.manual_seed(self.config.seed * 1_000_003 + ctx.comm.rank)
        self.reduce_generator = torch.Generator(device=ctx.runtime.device)
        self.reduce_generator.manual_seed(self.config.seed * 1_000_003 + ctx.comm.rank + 500_009)

    def bucket_ready(self, bucket: Bucket) -> Handle[Tensor]:
        flat = self._with_momentum(bucket)
        center = self.centers.get(bucket.index) if self.config.aggregator == "centered_clip" \
            else None
        seed = self.config.seed * 1_000_003 + self.calls  # same on every rank
        self.calls += 1

        def fn(rows: Tensor, info: ShardInfo) -> Tensor:
            mine = None if center is None else _slice(center, info)
            gen = torch.Generator().manual_seed(seed)
            return reduce_rows(rows, self.config, info.allreduce, mine, gen)

        handle = shard_map(self.ctx.comm, flat, fn, self.compressor, self.generator,
                           reduce_generator=self.reduce_generator)
        if self.config.aggregator != "centered_clip":
            return handle
        return handle.then(lambda out: self._remember(bucket.index, out))

    def _with_momentum(self, bucket: Bucket) -> Tensor:
        beta = self.config.momentum
        if beta == 0.0:
            return bucket.flat
        m = self.momenta.get(bucket.index)
        if m is None or m.shape != bucket.flat.shape:
            m = self.momenta[bucket.index] = bucket.flat.detach().clone()
        else:
            m.mul_(beta).add_(bucket.flat, alpha=1 - beta)
        return m

    def _remember(self, index: int, out: Tensor) -> Tensor:
        self.centers[index] = out.detach().clone()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"momenta": {k: v.clone() for k, v in self.momenta.items()},
                "centers": {k: v.clone() for k, v in self.centers.items()},
                "calls": self.calls, "generator": self.generator.get_state(),
                "reduce_generator": self.reduce_generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momenta = {int(k): v.clone() for k, v in state["momenta"].items()}
        self.centers = {int(k): v.clone() for k, v in state["centers"].items()}
        self.calls = int(state["calls"])
        self.generator.set_state(state["generator"])
        self.reduce_generator.set_state(state["reduce_generator"])


def _slice(flat: Tensor, info: ShardInfo) -> Tensor:
    """This shard of a full-length vector, zero-padded to ``info.length``."""
    part = flat.reshape(-1)[info.start:info.start + info.length]
    if part.numel() < info.length:
        part = torch.cat([part, part.new_zeros(info.length - part.numel())])
    return part
