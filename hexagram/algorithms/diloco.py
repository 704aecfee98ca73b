"""DiLoCo and streaming DiLoCo: inner optimizer for H steps, outer Nesterov on the average.

DiLoCo (Douillard et al. 2023): every rank runs the wrapped (inner) optimizer, e.g. AdamW,
for ``period`` steps from the shared weights ``anchor``; then the pseudo-gradient
``delta_i = anchor - x_i`` is averaged over ranks (optionally compressed, e.g. 8-bit) and an
outer SGD step with Nesterov momentum updates the shared weights::

    d = sum_i Q(delta_i) / n          # n: ranks that stepped since the last sync
    m = outer_momentum * m + d
    anchor = anchor - outer_lr * (d + outer_momentum * m)
    x_i = anchor                      # every rank restarts from the new shared weights

The outer step runs in ``after_step`` (once every optimizer has taken its ``step()`` number
``k * period``: e.g. Muon for the matrices and AdamW for the rest), so the next forward
pass uses the new shared weights.

Streaming DiLoCo (2025) with ``fragments = F > 1``: the tensors are split into F contiguous
fragments of similar size; fragment ``r mod F`` is synchronised (same formula, its own
momentum) every ``period / F`` steps, so each fragment is still synchronised every
``period`` steps but traffic is spread evenly instead of arriving in bursts.

Overlap (streaming DiLoCo's overlapping communication) with ``overlap_steps = tau > 0``: the
fragment's pseudo-gradient exchange is started asynchronously after step ``t`` and inner
steps go on; after step ``t + tau`` its (unchanged) outer step gives the new shared fragment
``anchor`` and the local fragment, which took ``tau`` more inner steps meanwhile, is merged::

    x_f = overlap_mix * x_f + (1 - overlap_mix) * anchor_f     # applied late

(``overlap_mix = 0`` drops the ``tau`` local steps of that fragment; the paper's mixing
keeps part of them). The next pseudo-gradient of the fragment is again ``anchor - x``. An
exchange completed before any further inner step (``tau = 0``, or forced by
``synchronize()`` / ``close()``) replaces the fragment by ``anchor`` as without overlap.
``tau < period``, so a fragment's exchange always lands before its own next one starts.
``synchronize()`` and ``close()`` complete every exchange in flight (no rank is left
waiting); ``state_dict()`` waits for their results (collectives every rank has issued, so
this never blocks on a peer's progress) and saves them with the step at which they apply,
so a resumed run applies them at the same step: resumption stays exact.

Example:
    >>> DiLoCoConfig(period=50, fragments=5).outer_lr
    0.7
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
from hexagram.comm.communicator import Handle
from hexagram.comm.reduce import Route, route
from hexagram.compress.base import Compressor
from hexagram.config import check_float, check_int
from hexagram.cost.payload_size import payload_nbytes
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
        overlap_steps: inner steps run while a fragment's exchange is in flight (tau, in
            ``[0, period)``); 0 => the exchange blocks the step that starts it; more =>
            more time to hide the network, staler outer updates.
        overlap_mix: weight of the local fragment when an outer update lands late, in
            ``[0, 1]``; 0 => replaced by the shared fragment; larger => keeps more of the
            inner steps taken while the exchange was in flight.
    """

    period: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compressor: str | Compressor | None = None
    fragments: int = 1
    overlap_steps: int = 0
    overlap_mix: float = 0.5

    def __post_init__(self) -> None:
        check_int(self, "period", low=1)
        check_float(self, "outer_lr", low=0.0, low_open=True)
        check_float(self, "outer_momentum", low=0.0, high=1.0, high_open=True)
        check_compressor_spec(self, "compressor", allow_none=True)
        check_int(self, "fragments", low=1)
        check_int(self, "overlap_steps", low=0)
        check_float(self, "overlap_mix", low=0.0, high=1.0)
        if self.period % self.fragments:
            raise ConfigError(f"DiLoCoConfig.period ({self.period}) must be a multiple of "
                              f"DiLoCoConfig.fragments ({self.fragments})")
        if self.overlap_steps >= self.period:
            raise ConfigError(f"DiLoCoConfig.overlap_steps ({self.overlap_steps}) must be "
                              f"< period ({self.period}): a fragment's exchange must land "
                              "before its next one starts")


@dataclass
class _InFlight:
    """A fragment's pseudo-gradient exchange started after step ``start`` (sum over ranks
    per bucket of the fragment), whose outer update applies after step ``due``."""

    fragment: int
    start: int
    due: int
    contributors: int
    sums: list[Handle[torch.Tensor]]


def _nbytes(comp: Compressor, shape: tuple[int, ...]) -> int:
    """Wire bytes of ``comp``'s payload of a float32 tensor of ``shape``."""
    sized = payload_nbytes(comp, shape)
    return sized if sized is not None else comp.compress(torch.zeros(shape)).nbytes


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
    #: True where the exchange encodes itself (error feedback): no scatter-gather route
    exact_local = False

    def __init__(self, config: DiLoCoConfig | None = None) -> None:
        super().__init__(config or DiLoCoConfig())
        self.config: Any
        self.outer: DiLoCoConfig = self.config  # the outer step and schedule (see LocalSGD)
        self.compressor = as_compressor(self.outer.compressor)

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        self.fragments = _split(ctx.buckets, self.outer.fragments)
        with_momentum = self.outer.outer_momentum > 0  # none at all for local SGD
        self.momentum = [[torch.zeros_like(b.flat) for b in f] if with_momentum else []
                         for f in self.fragments]
        self.fresh = [False] * len(self.fragments)  # local steps since the fragment's sync
        self.inflight: list[_InFlight] = []  # exchanges started, outer update not applied
        self._after_consensus()

    def _after_consensus(self) -> None:
        self.anchor = [read_weights(f) for f in self.fragments]
        self.fresh = [False] * len(self.fragments)

    def _on_step(self) -> None:
        self.fresh = [True] * len(self.fragments)
        while self.inflight and self.inflight[0].due <= self.step:
            self._apply(self.inflight.pop(0))
        if self._due(self.step):
            self._round(active=True)

    def _due(self, step: int) -> bool:
        """True when a round follows the first optimizer's ``step()`` number ``step``."""
        return step % (self.outer.period // self.outer.fragments) == 0

    def _round(self, active: bool) -> int:
        f = self.rounds % len(self.fragments)
        self.rounds += 1
        counts = self._control(active, contributing=self.fresh[f]).wait()
        if counts.contributing > 0:  # identical decision everywhere
            exchange = self._start(f, counts.contributing)
            if active and self.outer.overlap_steps > 0:
                self.inflight.append(exchange)  # applied in _on_step, tau steps later
            else:  # no inner step to overlap: apply now, as without overlap
                self._apply(exchange)
        self._sync_buffers()
        self.dirty = False
        # host read (kept, weight algorithm: once per outer step): active ranks, for the
        # engine's join and elastic checks
        return int(counts.active)

    def _start(self, f: int, n: int) -> _InFlight:
        """Start the sum over ranks of the fragment's pseudo-gradients ``anchor - x``."""
        local = read_weights(self.fragments[f])
        deltas = [a - x if self.fresh[f] else torch.zeros_like(x)
                  for a, x in zip(self.anchor[f], local)]
        self.fresh[f] = False
        sums = [compressed_sum(self.ctx.comm, d, self.compressor, b.entries)
                for b, d in zip(self.fragments[f], deltas)]
        return _InFlight(f, self.step, self.step + self.outer.overlap_steps, n, sums)

    def _apply(self, exchange: _InFlight) -> None:
        """Outer Nesterov step of the fragment; merge if inner steps ran meanwhile."""
        f = exchange.fragment
        buckets, anchor = self.fragments[f], self.anchor[f]
        mu, lr = self.outer.outer_momentum, self.outer.outer_lr
        for i, (a, h) in enumerate(zip(anchor, exchange.sums)):
            d = h.wait() / exchange.contributors
            if mu > 0:
                m = self.momentum[f][i].mul_(mu).add_(d)
                d = d + mu * m
            a.sub_(lr * d)
        late, mix = self.step > exchange.start, self.outer.overlap_mix
        if late and mix > 0:  # x_f = mix * x_f + (1 - mix) * anchor_f
            local = read_weights(buckets)
            write_weights(buckets, [mix * x + (1 - mix) * a for x, a in zip(local, anchor)])
            self.fresh[f] = True  # the merged fragment differs from the anchor
        else:
            write_weights(buckets, anchor)
            self.fresh[f] = False

    def round_messages(self, shapes: Sequence[tuple[int, ...]], world: int
                       ) -> list[tuple[str, int]]:
        """``(collective, bytes this rank sends)`` of one period (every fragment synced
        once) for tensors of ``shapes``, as the exchange routes them
        (:func:`hexagram.comm.reduce.route`); each tensor sized on its own (the engine's
        buckets join tensors, which changes only chunk headers and padding)."""
        if world < 2:
            return []
        comp, way = self.compressor, route(self.compressor, exact_local=self.exact_local)
        total = {"allreduce": 0, "alltoall": 0, "allgather": 0}
        for shape in shapes:
            n = math.prod(shape)
            if comp is None or way is Route.ALLREDUCE:
                total["allreduce"] += 2 * (world - 1) * 4 * n // world
            elif way is Route.SUM:
                total["allreduce"] += 2 * (world - 1) * _nbytes(comp, (n,)) // world
            elif way is Route.SCATTER_GATHER:
                chunk = _nbytes(comp, (-(-n // world),))
                total["alltoall"] += (world - 1) * chunk
                total["allgather"] += (world - 1) * chunk
            else:
                total["allgather"] += (world - 1) * _nbytes(comp, (n,))
        return [(op, sent) for op, sent in total.items() if sent]

    def _finish_pending(self) -> None:
        while self.inflight:
            self._apply(self.inflight.pop(0))

    def close(self) -> None:
        """Complete exchanges in flight (every rank issued them: no rank is left waiting)."""
        self._finish_pending()

    def state_dict(self) -> dict[str, Any]:
        state = self._base_state()
        state["fresh"] = list(self.fresh)
        state["schedule"] = self._schedule()
        state["anchor"], state["outer_momentum"] = {}, {}
        for f, buckets in enumerate(self.fragments):
            state["anchor"].update(named_from_flats(buckets, self.anchor[f]))
            state["outer_momentum"].update(named_from_flats(buckets, self.momentum[f]))
        state["inflight"] = [  # results awaited (identical on every rank), applied later
            {"fragment": x.fragment, "start": x.start, "due": x.due, "n": x.contributors,
             "sums": named_from_flats(self.fragments[x.fragment], [h.wait() for h in x.sums])}
            for x in self.inflight]
        if self.compressor is not None:  # after the waits: compression jobs have run
            state["compressor"] = self.compressor.state_dict()
        return state

    def _schedule(self) -> dict[str, int]:
        """Settings that fix which fragment syncs when (a checkpoint needs the same)."""
        cfg = self.outer
        return {"period": cfg.period, "fragments": cfg.fragments,
                "overlap_steps": cfg.overlap_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("schedule", self._schedule())
        if saved != self._schedule():
            raise ConfigError(f"{self.name}: checkpoint was saved with {saved}, this algorithm "
                              f"has {self._schedule()}; use the same config to resume")
        self._load_base_state(state)
        self.fresh = [bool(x) for x in state["fresh"]]
        self.anchor = [flats_from_named(b, state["anchor"], "diloco anchor")
                       for b in self.fragments]
        self.momentum = [flats_from_named(b, state["outer_momentum"], "diloco momentum")
                         if self.momentum[f] else [] for f, b in enumerate(self.fragments)]
        for x in self.inflight:  # exchanges of the replaced state: let them land, unapplied
            for h in x.sums:
                h.wait()
        self.inflight = [
            _InFlight(x["fragment"], int(x["start"]), int(x["due"]), int(x["n"]),
                      [Handle.completed(t) for t in flats_from_named(
                          self.fragments[x["fragment"]], x["sums"], "diloco in-flight sums")])
            for x in state.get("inflight", [])]
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])
