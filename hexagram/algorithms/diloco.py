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
from functools import partial
from typing import Any

import torch

from hexagram.algorithms.base import AlgorithmContext
from hexagram.algorithms.finite import non_finite
from hexagram.algorithms.flat_weights import (
    FlatWeights,
    Named,
    by_dtype_and_device,
    named_copies,
    split_groups,
)
from hexagram.algorithms.weight_sync import (
    RoundAlgorithm,
    as_compressor,
    check_compressor_spec,
    compressed_sum,
)
from hexagram.comm import primitives
from hexagram.comm.communicator import Handle
from hexagram.comm.reduce import Route, route
from hexagram.compress.base import Compressor
from hexagram.config import check_float, check_int
from hexagram.cost.payload_size import payload_nbytes
from hexagram.errors import ConfigError, NonFiniteGradientError

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
    """A fragment's pseudo-gradient exchange started after step ``start`` (sum over ranks,
    one flat buffer per dtype and device of the fragment), whose outer update applies
    after step ``due``."""

    fragment: int
    start: int
    due: int
    contributors: int
    sums: list[Handle[torch.Tensor]]


@dataclass
class _Local:
    """What a rank prepared for a fragment's round before the control collective: its
    update per flat buffer (pseudo-gradients, or encoded payloads) and, where the round
    checks finiteness, a 0-dim device flag (True: NaN/Inf)."""

    updates: list[Any]
    nonfinite: torch.Tensor | None


def _nbytes(comp: Compressor, shape: tuple[int, ...]) -> int:
    """Wire bytes of ``comp``'s payload of a float32 tensor of ``shape``."""
    sized = payload_nbytes(comp, shape)
    return sized if sized is not None else comp.compress(torch.zeros(shape)).nbytes


def _nonfinite_update(name: str, fragment: int) -> str:
    return (f"algorithm {name!r}: the averaged outer update of fragment {fragment} holds "
            "NaN or Inf (a rank sent NaN/Inf; the sender cannot be known from a sum); the "
            "shared weights were left unchanged. Lower the inner learning rate, clip "
            "gradients or use loss scaling; if a rank is faulty or hostile, check its host")


def any_flag(flags: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 0-dim bool tensor: any of ``flags`` (0-dim bool tensors of one device)."""
    return flags[0] if len(flags) == 1 else torch.stack(list(flags)).any()


class DiLoCoAlgorithm(RoundAlgorithm):
    """Inner steps locally, outer Nesterov step on averaged pseudo-gradients.

    The weights of each fragment live in flat buffers (:class:`~hexagram.algorithms.
    flat_weights.FlatWeights`, one per dtype and device): an outer step reads and writes
    the parameters with one ``_foreach_copy_`` each and updates anchor and momentum with
    element-wise kernels over the buffers, whatever the number of tensors.
    """

    name = "diloco"
    #: True where the exchange encodes itself (error feedback): no scatter-gather route
    exact_local = False
    #: what arrives (malformed payloads, an outer update holding NaN/Inf) is checked on the
    #: device and raised at the next round's control collective, on every rank
    checks_received = True

    def __init__(self, config: DiLoCoConfig | None = None) -> None:
        super().__init__(config or DiLoCoConfig())
        self.config: Any
        self.outer: DiLoCoConfig = self.config  # the outer step and schedule (see LocalSGD)
        self.compressor = as_compressor(self.outer.compressor)
        # a compressor's own NaN/Inf check reads the device per tensor; the round checks
        # its update once instead, in the control collective (RoundAlgorithm._control)
        self._checks = self.compressor is not None and self.compressor.checks_finite
        if self.compressor is not None:
            self.compressor.checks_finite = False

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        named = [(e.name, e.param) for b in ctx.buckets for e in b.entries]
        self.fragments = [self._lay_out(g) for g in split_groups(named, self.outer.fragments)]
        with_momentum = self.outer.outer_momentum > 0  # none at all for local SGD
        self.momentum = [[w.new() for w in f] if with_momentum else []
                         for f in self.fragments]
        self._scratch = [[w.new() for w in f] for f in self.fragments]  # local weights
        self.fresh = [False] * len(self.fragments)  # local steps since the fragment's sync
        self.inflight: list[_InFlight] = []  # exchanges started, outer update not applied
        self._after_consensus()

    def _lay_out(self, named: Named) -> list[FlatWeights]:
        """The flat buffers of a fragment's tensors (end to end, one per dtype/device)."""
        return [FlatWeights(g) for g in by_dtype_and_device(named)]

    def _after_consensus(self) -> None:
        self.anchor = [[w.new() for w in f] for f in self.fragments]
        for f, a in zip(self.fragments, self.anchor):
            for w, flat in zip(f, a):
                w.read(flat)
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
        local = self._prepare(f) if self.fresh[f] else None
        flag: torch.Tensor | bool | None = None
        if self._checks:  # every rank sends the flag (False: nothing of its own to check)
            flag = False if local is None or local.nonfinite is None else local.nonfinite
        counts = self._control(active, contributing=self.fresh[f], nonfinite=flag).wait()
        if getattr(counts, "nonfinite", 0):  # identical on every rank: all stop here
            raise NonFiniteGradientError(self._nonfinite_message(f, counts.nonfinite, local))
        if counts.contributing > 0:  # identical decision everywhere
            exchange = self._start(f, counts.contributing, local)
            if active and self.outer.overlap_steps > 0:
                self.inflight.append(exchange)  # applied in _on_step, tau steps later
            else:  # no inner step to overlap: apply now, as without overlap
                self._apply(exchange)
        self._sync_buffers()
        self.dirty = False
        # host read (kept, weight algorithm: once per outer step): active ranks, for the
        # engine's join and elastic checks
        return int(counts.active)

    def _prepare(self, f: int) -> _Local:
        """The fragment's pseudo-gradients ``anchor - x``, one flat buffer per dtype and
        device (in the fragment's scratch buffers), and their NaN/Inf flag if checked."""
        deltas = []
        for w, a, x in zip(self.fragments[f], self.anchor[f], self._scratch[f]):
            w.read(x)
            deltas.append(torch.sub(a.flat, x.flat, out=x.flat))
        flags = [~torch.isfinite(d).all() for d in deltas] if self._checks else []
        return _Local(deltas, any_flag(flags) if flags else None)

    def _nonfinite_message(self, f: int, ranks: int, local: _Local | None) -> str:
        """Names the first tensor of this rank whose update holds NaN/Inf (reads the
        device tensor by tensor: only on the way to the error)."""
        where = "on another rank"
        for w, x in zip(self.fragments[f], self._scratch[f]):
            bad = [n for n, v in zip(w.names, x.views) if not bool(torch.isfinite(v).all())]
            if local is not None and bad:
                where = f"here first in parameter {bad[0]!r}"
                break
        return (f"algorithm {self.name!r}: the outer update of round {self.rounds} holds "
                f"NaN or Inf on {ranks} rank(s) ({where}), detected before sending. Lower "
                "the inner learning rate, clip gradients or use loss scaling")

    def _start(self, f: int, n: int, local: _Local | None) -> _InFlight:
        """Start the sum over ranks of the fragment's pseudo-gradients (zeros where this
        rank has nothing new since the fragment's last sync)."""
        self.fresh[f] = False
        deltas = local.updates if local is not None else \
            [torch.zeros_like(a.flat) for a in self.anchor[f]]
        if self.compressor is None:  # in place: the scratch is free again once it lands
            sums = [primitives.allreduce(self.ctx.comm, d, average=False) for d in deltas]
        else:
            sums = [compressed_sum(self.ctx.comm, d, self.compressor, w.entries,
                                   faults=self._received_sink())
                    for w, d in zip(self.fragments[f], deltas)]
        return _InFlight(f, self.step, self.step + self.outer.overlap_steps, n, sums)

    def _apply(self, exchange: _InFlight) -> None:
        """Outer Nesterov step of the fragment; merge if inner steps ran meanwhile."""
        f = exchange.fragment
        mu, lr = self.outer.outer_momentum, self.outer.outer_lr
        n = exchange.contributors
        for i, (a, h) in enumerate(zip(self.anchor[f], exchange.sums)):
            # x / 1 and 1.0 * x are exact: those passes over the buffer are skipped
            d = self._usable(h.wait() if n == 1 else h.wait() / n, f)
            if mu > 0:
                m = self.momentum[f][i].flat.mul_(mu).add_(d)
                d = d + mu * m
            a.flat.sub_(d if lr == 1.0 else lr * d)
        late, mix = self.step > exchange.start, self.outer.overlap_mix
        for w, a, x in zip(self.fragments[f], self.anchor[f], self._scratch[f]):
            if late and mix > 0:  # x_f = mix * x_f + (1 - mix) * anchor_f
                w.read(x)
                x.flat.copy_(mix * x.flat + (1 - mix) * a.flat)
                w.write(x)
            else:
                w.write(a)
        self.fresh[f] = late and mix > 0  # a merged fragment differs from the anchor

    def _usable(self, d: torch.Tensor, f: int) -> torch.Tensor:
        """The averaged outer update ``d``, zeroed in place where it holds NaN/Inf (a rank
        sent NaN/Inf, or a malformed payload decoded so): the shared weights stay as they
        were, and the flag rides in the next round's control collective, which raises on
        every rank. No host read; bit for bit ``d`` where it is finite."""
        bad = non_finite(d)
        self._received(bad, -1, partial(_nonfinite_update, self.name, f))  # no cycle
        return d.masked_fill_(bad, 0.0)

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
        for f, weights in enumerate(self.fragments):
            state["anchor"].update(named_copies(weights, self.anchor[f]))
            state["outer_momentum"].update(named_copies(weights, self.momentum[f]))
        state["inflight"] = [  # results awaited (identical on every rank), applied later
            {"fragment": x.fragment, "start": x.start, "due": x.due, "n": x.contributors,
             "sums": named_copies(self.fragments[x.fragment], [h.wait() for h in x.sums])}
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
        self.anchor = [[w.load(state["anchor"], "diloco anchor") for w in f]
                       for f in self.fragments]
        self.momentum = [[w.load(state["outer_momentum"], "diloco momentum") for w in f]
                         if self.momentum[i] else [] for i, f in enumerate(self.fragments)]
        for x in self.inflight:  # exchanges of the replaced state: let them land, unapplied
            for h in x.sums:
                h.wait()
        self.inflight = [
            _InFlight(x["fragment"], int(x["start"]), int(x["due"]), int(x["n"]),
                      [Handle.completed(w.load(x["sums"], "diloco in-flight sums").flat)
                       for w in self.fragments[x["fragment"]]])
            for x in state.get("inflight", [])]
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])
