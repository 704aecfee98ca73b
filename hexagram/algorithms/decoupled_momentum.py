"""DeMo, decoupled momentum (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870).

Each rank keeps its own momentum and sends only its fast components. Per step and tensor
(``g`` the local gradient, ``beta`` the momentum)::

    m <- beta * m + g (+ wd * w)           the momentum stays on the rank
    q <- IDCT(TopK_chunk(DCT(m)))          chunked DCT-II, k of every `chunk` coefficients
    m <- m - q                             what is sent leaves the local momentum
    Q <- mean over ranks of q              allgather of (values, positions), decoded
    w <- w - lr * sign(Q) * rms(Q) / (1 - beta)     rms(Q) = ||Q|| / sqrt(numel), per tensor

The paper applies ``sign(Q)`` with a learning rate tuned for signs (signum). Here, to be a
drop-in with the user's learning rate, the sign is scaled by the RMS of the decoded update
``Q`` (as scaled ``signsgd`` does) and by ``1 / (1 - beta)``: what is sent leaves the
momentum, so a gradient moves the weights about once instead of ``1 / (1 - beta)`` times
as under SGD's momentum; the factor restores SGD's total step. Measured (digits MLP, 4
ranks, the user's SGD lr 0.05 momentum 0.9 taken over, 8 epochs; allreduce 91.5 %): 91.8 %
with the factor, 54.3 % without. The optimizer
runs without momentum on ``sign(Q) * rms(Q)``: with ``momentum=None`` (the default) DeMo
takes over the momentum and weight decay of the user's ``torch.optim.SGD`` (no Nesterov, no
dampening) as DGC does (:mod:`hexagram.algorithms.momentum_correction`), warned at wrap
time and given back at ``close()``. Any other optimizer (Adam, AdamW, Muon, ...) cannot be
taken over: its own moments would act on DeMo's sign update, so the wrap raises
:class:`~hexagram.errors.ConfigError` naming it.

The transform and wire format are :class:`~hexagram.compress.dct.DCTTopKCompressor`'s
(chunk 64 and top-k 32 by default, the paper's; values in bfloat16, positions in 6 bits).
Every rank decodes every rank's payload in rank order: all apply the same bits. The
momenta are saved under ``state["feedback"]["residuals"]`` (the unsent part, as residuals
are), so live elastic mode treats them with its named residual policy
(:mod:`hexagram.elastic.residuals`).

Example:
    >>> DeMoConfig().chunk, DeMoConfig().k
    (64, 32)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hexagram.algorithms.base import AlgorithmContext
from hexagram.algorithms.compressed import CompressedConfig, CompressorAlgorithm
from hexagram.algorithms.flat_weights import Flat, FlatWeights
from hexagram.algorithms.momentum_correction import MomentumCorrection
from hexagram.buckets import Bucket, BucketEntry
from hexagram.comm import primitives
from hexagram.comm.communicator import Handle
from hexagram.comm.faults import check_ranks
from hexagram.compress.base import Payload
from hexagram.compress.dct import DCTTopKCompressor, DCTTopKConfig
from hexagram.compress.dct_flat import DCTTopKRows
from hexagram.compress.faults import any_of
from hexagram.config import check_float
from hexagram.errors import ConfigError

__all__ = ["DeMoAlgorithm", "DeMoConfig", "check_optimizers"]


@dataclass(frozen=True, kw_only=True)
class DeMoConfig(CompressedConfig):
    """Config of :class:`DeMoAlgorithm` (plus :class:`CompressedConfig`'s fields).

    Attributes:
        chunk: elements per DCT chunk (s); larger => finer spectrum, more position bits.
        k: coefficients sent per chunk; fewer => fewer bytes, more kept in the momentum.
        wire_dtype: dtype of the sent values (``"bfloat16"``, ``"float16"``, ``"float32"``).
        momentum: beta; None => the user's SGD momentum, taken over (a drop-in); a number
            => this one (the SGD must then have momentum 0). Higher => smoother.
    """

    algorithm = "decoupled_momentum"

    chunk: int = 64
    k: int = 32
    wire_dtype: str = "bfloat16"
    momentum: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.momentum is not None:
            check_float(self, "momentum", low=0.0, high=1.0, high_open=True)
        DCTTopKConfig(chunk=self.chunk, k=self.k, wire_dtype=self.wire_dtype)
        if self.granularity != "layer":
            raise ConfigError("DeMoConfig.granularity must be 'layer': the momentum and its "
                              "DCT are per tensor")


def check_optimizers(optimizers: list[torch.optim.Optimizer], explicit: bool) -> None:
    """Raise :class:`ConfigError` unless every optimizer is a plain SGD DeMo can run on."""
    for opt in optimizers:
        if type(opt) is not torch.optim.SGD:
            raise ConfigError(
                f"algorithm 'decoupled_momentum' cannot take over {type(opt).__name__}: DeMo "
                "replaces the optimizer's momentum and steps on a sign update, which "
                f"{type(opt).__name__}'s own moments would rescale. Use torch.optim.SGD "
                "(with momentum, taken over) or another algorithm (e.g. 'dgc', 'sparseloco')")
        for group in opt.param_groups:
            if group.get("nesterov") or group.get("dampening"):
                raise ConfigError("algorithm 'decoupled_momentum': SGD with nesterov or "
                                  "dampening cannot be taken over; use plain momentum")
            if not explicit and not group.get("momentum"):
                raise ConfigError("algorithm 'decoupled_momentum': the SGD has no momentum "
                                  "to take over; give SGD momentum (e.g. 0.9) or pass "
                                  "decoupled_momentum momentum=<float>")


class DeMoAlgorithm(MomentumCorrection, CompressorAlgorithm):
    """Decoupled momentum: local momenta, their top DCT components exchanged (module doc)."""

    name = "decoupled_momentum"
    custom_encoding = True

    def __init__(self, config: DeMoConfig | None = None) -> None:
        super().__init__(config or DeMoConfig())
        self.config: DeMoConfig
        c = self.config
        self.use_compressor(DCTTopKCompressor(DCTTopKConfig(
            chunk=c.chunk, k=c.k, wire_dtype=c.wire_dtype)), feedback=False)

    def refuses(self, optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
        """Why DeMo cannot run on ``optimizers`` (what ``setup`` would raise), or None;
        ``auto`` leaves it out then."""
        try:
            check_optimizers(list(optimizers), self.config.momentum is not None)
        except ConfigError as e:
            return str(e)
        return None

    def setup(self, ctx: AlgorithmContext) -> None:
        check_optimizers(list(ctx.optimizers), self.config.momentum is not None)
        super().setup(ctx)
        self._plans: dict[int, _Plan] = {}

    def reset(self, ctx: AlgorithmContext) -> None:
        super().reset(ctx)
        self._plans = {}  # buckets re-formed: new layouts (the momenta move by name)

    def close(self) -> None:
        """Let go of the engine's buckets (the plans' views of the gradients); the momenta
        stay, for a checkpoint after ``close()``."""
        for plan in getattr(self, "_plans", {}).values():
            plan.source, plan.grads = None, []
        super().close()

    def reduce_bucket(self, bucket: Bucket) -> Handle[Tensor]:
        """m <- beta m + g; send the top DCT components of m (ONE payload for the bucket);
        remove them from m; the handle's result is ``sign(Q) rms(Q) gain`` per tensor in
        ``bucket.flat``, Q the mean of every rank's decoded components."""
        plan = self._plan(bucket)
        self._accumulate(plan)
        payload, sent = plan.coder.encode(plan.momentum.flat)
        plan.coder.inverse([sent], plan.own.flat)  # q: decoded once, for m and the mean
        plan.momentum.flat.sub_(plan.own.flat)
        comm = self.ctx.comm

        def finish(gathered: list[list[Payload]]) -> Tensor:
            mean = plan.own
            if comm.size > 1:  # sum of the spectra in rank order, one inverse transform
                mean = plan.mean
                faults: list[list[Tensor]] = [[] for _ in gathered[0]]
                plan.coder.inverse([sent if r == comm.rank else plan.coder.decode(p, faults[r])
                                    for r, p in enumerate(gathered[0])], mean.flat)
                # every rank decodes the same bytes: the same flag, read with the step's
                check_ranks(self.ctx.checks.add, [any_of(f) if f else None for f in faults],
                            self.name, f"a bucket of {len(plan.entries)} tensor(s)")
                mean.flat.div_(comm.size)  # the mean (world 1: x / 1, exact, skipped)
            self._scaled_sign(plan, mean)
            torch._foreach_copy_(plan.grads, mean.views)
            return bucket.flat

        return primitives.allgather_payloads_many(comm, [payload]).then(finish)

    def _plan(self, bucket: Bucket) -> _Plan:
        """The bucket's flat layout and buffers, made at its first step (cached by its
        entries; the momenta by name are moved in, and stay views of the buffer)."""
        plan = self._plans.get(id(bucket.entries))
        if plan is None or plan.entries is not bucket.entries:
            plan = self._plans[id(bucket.entries)] = _Plan.make(self, bucket)
        if plan.source is not bucket.flat:  # the gradients' views, once per buffer
            plan.source = bucket.flat
            plan.grads = [bucket.view(e) for e in bucket.entries]
        return plan

    def _accumulate(self, plan: _Plan) -> None:
        """u <- momentum * u + g (+ wd * w) per tensor: a few ``_foreach`` kernels."""
        m = plan.momentum.views
        torch._foreach_mul_(m, plan.betas)
        torch._foreach_add_(m, plan.grads)
        with torch.no_grad():
            for wd, (views, params) in plan.decay.items():
                torch._foreach_add_(views, params, alpha=wd)

    def _scaled_sign(self, plan: _Plan, mean: Flat) -> None:
        """Q -> sign(Q) * rms(Q) * gain per tensor, in place, on the device."""
        scale = torch.stack(torch._foreach_norm(mean.views)).mul_(plan.gains)
        rows = scale.index_select(0, plan.row_tensor)  # each chunk's tensor's scale
        mean.flat.sign_()
        for g, (a, b) in zip(plan.coder.layout.groups, plan.row_spans):
            g.view(mean.flat).mul_(rows[a:b, None])

    def gain(self, name: str) -> float:
        """Factor of the RMS-scaled sign of tensor ``name``: ``1 / (1 - beta)`` (module
        doc: the step SGD's momentum would make from the same gradients)."""
        beta = self.factors.get(name, (self.config.momentum or 0.0, 0.0))[0]
        return 1.0 / (1.0 - beta)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["feedback"] = {"residuals": state.pop("momenta")}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["momenta"] = state["feedback"]["residuals"]
        state["feedback"] = None
        super().load_state_dict(state)
        self._plans = {}  # the loaded momenta move into new buffers at the next step


@dataclass
class _Plan:
    """A bucket's flat layout (its tensors cut into DCT chunks) and buffers: the momenta,
    this rank's decoded components, the mean; per-tensor factors as device tensors."""

    entries: list[BucketEntry]
    coder: DCTTopKRows
    momentum: Flat
    own: Flat
    mean: Flat
    betas: list[float]
    decay: dict[float, tuple[list[Tensor], list[Tensor]]]
    gains: Tensor
    row_tensor: Tensor
    row_spans: list[tuple[int, int]]
    source: Tensor | None = None
    grads: list[Tensor] = dataclasses.field(default_factory=list)

    @classmethod
    def make(cls, algo: DeMoAlgorithm, bucket: Bucket) -> _Plan:
        entries, flat = bucket.entries, bucket.flat
        coder = DCTTopKRows(algo.compressor.config, [e.numel for e in entries], flat.dtype)
        weights = FlatWeights([(e.name, e.param) for e in entries], coder.layout.offsets,
                              coder.layout.numel)

        def buffer() -> Flat:
            t = torch.zeros(coder.layout.numel, dtype=flat.dtype, device=flat.device)
            return Flat(t, weights.views(t))

        momentum, default = buffer(), (algo.config.momentum or 0.0, 0.0)
        for e, view in zip(entries, momentum.views):  # once per layout: move them in
            old = algo.momenta.get(e.name)
            if old is not None and old.numel() == e.numel and old.dtype == flat.dtype:
                view.copy_(old.view(e.shape))
            algo.momenta[e.name] = view.view(-1)
        factors = [algo.factors.get(e.name, default) for e in entries]
        decay: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
        for e, view, (_, wd) in zip(entries, momentum.views, factors):
            if wd and e.name in algo._params:
                decay.setdefault(wd, ([], []))[0].append(view)
                decay[wd][1].append(algo._params[e.name])
        gains = [algo.gain(e.name) / e.numel ** 0.5 for e in entries]
        rows, spans, at = [], [], 0
        for g in coder.layout.groups:
            for t, count in zip(g.tensors, g.counts):
                rows += [t] * count
            spans.append((at, at + g.rows))
            at += g.rows
        return cls(entries, coder, momentum, buffer(), buffer(), [b for b, _ in factors],
                   decay, torch.tensor(gains, dtype=flat.dtype, device=flat.device),
                   torch.tensor(rows, device=flat.device), spans)
