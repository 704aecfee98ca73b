"""QAdam: Adam warm-up with gradient allreduce, then compressed momentum with error feedback.

The 1-bit Adam / QAdam family (DeepSpeed, BAGUA). Pair it with
:class:`hexagram.optim.QAdamOptimizer`, whose variance freezes after ``warmup_steps``:

- warm-up (``not optimizer.frozen``): each gradient bucket is averaged with a
  full-precision allreduce and the optimizer runs plain Adam;
- afterwards, per bucket during backward: ``x = (beta1 * m + (1 - beta1) * g) / d + e``
  (the momentum Adam would compute locally, divided by the frozen denominator
  ``d = sqrt(v_hat) + eps``, plus this rank's error-feedback residual ``e``, kept by
  :class:`hexagram.compress.feedback.ErrorFeedback` per parameter name) is compressed, every
  rank receives every rank's payload, ``m_bar = d * mean_j decompress(payload_j)`` and
  ``e <- x - decompress(my payload)``. The engine writes
  ``g_eff = (m_bar - beta1 * m) / (1 - beta1)`` into ``.grad``, so the optimizer's own
  momentum update yields exactly ``m_bar`` on every rank: weights and momenta stay identical
  across ranks while only compressed momenta cross the wire.

Why divide by ``d``: ``d`` is frozen and equal on every rank, so averaging ``m / d`` is
averaging ``m``; but quantization noise then scales with the *update* ``m / d`` instead of
being divided by ``d``. Compressing ``m`` itself, an 8-bit min-max error of ``range / 510``
on a parameter whose gradient was always zero (``d = eps``) becomes an update of
``lr * 1e5``: training diverges (observed on the digits MLP, whose border pixels are
always 0). The optimizer also floors the frozen variance (``variance_floor``), so ``d`` is
never ``~eps`` for an element that merely had no gradient during the warm-up: without the
floor, a ReLU unit dead during the warm-up that later comes back to life has ``x ~ g / eps``,
which spoils the min-max range of its whole bucket and steps its weights by ``lr * m / eps``.

Aggregation: summable payloads (fp16) use a compressed allreduce; other formats (8-bit
min-max, the default) are allgathered, which keeps the worker-side error feedback exact
(scatter-gather would re-quantize the reduced chunk without a residual). Per step a rank
sends ``(P - 1) * payload`` bytes: 8-bit payloads over 4 ranks are half of a float32 ring
allreduce.

Example:
    >>> QAdamConfig(compressor="fp16").compressor
    'fp16'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.algorithms.finite import non_finite
from hexagram.algorithms.weight_sync import as_compressor, check_compressor_spec
from hexagram.buckets import Bucket
from hexagram.comm import primitives
from hexagram.comm.communicator import Handle
from hexagram.comm.reduce import reduce
from hexagram.compress.base import Aggregation, Compressor, Payload
from hexagram.compress.feedback import ErrorFeedback
from hexagram.cost.facts import Shapes
from hexagram.cost.own_work import optimizer_step_s, qadam_own_cost
from hexagram.cost.profile import TreeCost
from hexagram.cost.schedule import (
    Message,
    TensorSpec,
    allreduce_messages,
    payload_of,
    ring_sent,
)
from hexagram.errors import ConfigError
from hexagram.optim.qadam import QAdamOptimizer

__all__ = ["QAdamAlgorithm", "QAdamConfig", "optimizer_extra_s"]


@dataclass(frozen=True, kw_only=True)
class QAdamConfig:
    """Config of :class:`QAdamAlgorithm` (the warm-up length is the optimizer's).

    Attributes:
        compressor: name or instance for the momentum after warm-up; fewer bits => fewer
            bytes, more error carried by the residual.
    """

    compressor: str | Compressor = "minmax8"

    def __post_init__(self) -> None:
        check_compressor_spec(self, "compressor", allow_none=False)


def optimizer_extra_s(shapes: Sequence[tuple[int, ...]], reps: int = 3) -> float:
    """CPU seconds a step of QAdam's optimizer (Adam, variance frozen) takes beyond an
    SGD-with-momentum step on ``shapes``, one intra-op thread: the lab's workers profile
    every cell's compute with SGD, the qadam cell runs :class:`QAdamOptimizer`
    (:func:`hexagram.cost.own_work.job_compute` adds the difference).

    >>> optimizer_extra_s([(64, 64)]) >= 0.0
    True
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        adam = optimizer_step_s(lambda ps: QAdamOptimizer(ps, lr=1e-3, warmup_steps=1),
                                shapes, reps)
        sgd = optimizer_step_s(lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
                               shapes, reps)
    finally:
        torch.set_num_threads(threads)
    return max(0.0, adam - sgd)

def _by_beta(betas: Sequence[float]) -> list[tuple[float, list[int]]]:
    """Positions grouped by beta1 (one group unless the optimizer's groups differ)."""
    groups: dict[float, list[int]] = {}
    for i, beta in enumerate(betas):
        groups.setdefault(beta, []).append(i)
    return list(groups.items())


class QAdamAlgorithm(Algorithm):
    """Gradient allreduce during warm-up, then compressed momentum; see the module doc."""

    name = "qadam"
    kind = "grad"
    own_work = "momentum"  # the momentum arithmetic before the encode and after the exchange

    def __init__(self, config: QAdamConfig | None = None) -> None:
        super().__init__(config or QAdamConfig())
        self.config: QAdamConfig
        compressor = as_compressor(self.config.compressor)
        assert compressor is not None
        self.compressor: Compressor = compressor
        # the payload's flag is read once per step instead (see _encode)
        compressor.checks_finite = False
        self.feedback = ErrorFeedback(compressor)  # residuals keyed by parameter name
        self._scratch: dict[int, Tensor] = {}  # per bucket: this rank's own Q(x), reused
        # per flat buffer (a bucket's, or its scratch): (entries, the tensors' views of it),
        # built once per layout: slicing every tensor every step cost two ops per tensor
        self._views: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        found = [o for o in ctx.optimizers if isinstance(o, QAdamOptimizer)]
        if len(found) != 1 or len(ctx.optimizers) != 1:
            raise ConfigError("algorithm 'qadam' needs exactly one optimizer, a "
                              "hexagram.optim.QAdamOptimizer, passed as optimizers=[opt]")
        self.optimizer = found[0]

    def bucket_ready(self, bucket: Bucket) -> Handle[Tensor]:
        if not self.optimizer.frozen:
            return primitives.allreduce(self.ctx.comm, bucket.flat, average=True)
        flat = bucket.flat
        grads = self._views_of(bucket, flat)
        moms, denoms, betas = self.optimizer.frozen_terms([e.param for e in bucket.entries])
        groups = _by_beta(betas)
        # in place, the bucket is ours until the handle completes: x = (beta m + (1 - beta)
        # g) / d + residual, per parameter (residuals are keyed by name)
        for beta, idx in groups:
            gs = [grads[i] for i in idx]
            torch._foreach_mul_(gs, 1 - beta)
            torch._foreach_add_(gs, [moms[i] for i in idx], alpha=beta)
        torch._foreach_div_(grads, denoms)
        self._correct(bucket, grads)

        def effective_grad(u: Tensor) -> Tensor:
            # g_eff = (mean_j u_j * d - beta m) / (1 - beta), in place; u is the mean
            if u is not flat:
                flat.copy_(u)
            torch._foreach_mul_(grads, denoms)
            for beta, idx in groups:
                gs = [grads[i] for i in idx]
                torch._foreach_sub_(gs, [moms[i] for i in idx], alpha=beta)
                torch._foreach_div_(gs, 1 - beta)
            return flat

        return self._exchange(bucket).then(effective_grad)

    def _views_of(self, bucket: Bucket, flat: Tensor) -> list[Tensor]:
        """Each tensor's view of ``flat`` (a buffer laid out as ``bucket``), built once per
        buffer and layout (the entries list's identity) and reused every step: no ops."""
        known = self._views.get(flat)
        if known is not None and known[0] is bucket.entries:
            return known[1]  # type: ignore[no-any-return]
        views = [bucket.view(e, flat) for e in bucket.entries]
        self._views[flat] = (bucket.entries, views)
        return views

    def _correct(self, bucket: Bucket, grads: list[Tensor]) -> None:
        """``g += residual`` for every tensor of the bucket that has one (one op)."""
        pairs = []
        for e, g in zip(bucket.entries, grads):
            r = self.feedback.residual(e.name)
            if r is None:
                continue
            if r.shape != g.shape or r.dtype != g.dtype:
                self.feedback.correct_(e.name, g)  # raises, naming the tensor
            pairs.append((g, r))
        if pairs:
            torch._foreach_add_([g for g, _ in pairs], [r for _, r in pairs])

    def _exchange(self, bucket: Bucket) -> Handle[Tensor]:
        """Send Q(x) (x: the bucket's contents), keep x - sent as the residuals. Returns the
        handle of the mean over ranks of Q(x_j), decoded into the bucket.

        :func:`hexagram.comm.reduce.reduce` picks the collective; our encoder keeps the
        residual exact (so scatter-gather formats are allgathered, see the module doc)."""
        c, x = self.compressor, bucket.flat

        def encode(_: int, t: Tensor, divisor: int) -> Payload:
            # summed formats (fp16) are divided by P first: sent = P * decode(payload)
            payload = c.compress(t / divisor if divisor > 1 else t)
            self._check_payload(payload, bucket)
            mine = self._scratch.get(bucket.index)
            if mine is None or mine.shape != t.shape or mine.dtype != t.dtype:
                mine = self._scratch[bucket.index] = torch.empty_like(t)
            c.decompress_into(payload, mine)
            self._update_residuals(bucket, mine.mul_(divisor) if divisor > 1 else mine)
            return payload

        return reduce(self.ctx.comm, x, c, out=x, encode=encode, faults=self.ctx.checks.add)

    def _check_payload(self, payload: Payload, bucket: Bucket) -> None:
        """Queue "the payload holds NaN/Inf" (its floats: min-max headers, cast values; the
        input's NaN/Inf and an fp16 overflow show there) for the step's one read."""
        floats = [t for t in payload.tensors if t.is_floating_point()]
        if not floats:
            return
        flag = torch.stack([non_finite(t.reshape(-1)) for t in floats]).any()
        self.ctx.checks.add(flag, lambda: (
            f"qadam: the compressed momentum of {', '.join(bucket.names)} holds NaN or Inf "
            f"({self.compressor.name}: a non-finite momentum, or values past the wire "
            "format's range). Lower the learning rate or raise variance_floor"))

    def _update_residuals(self, bucket: Bucket, mine: Tensor) -> None:
        """e <- x - Q(x) for every tensor of the bucket, in the old residuals' memory."""
        xs, sent = self._views_of(bucket, bucket.flat), self._views_of(bucket, mine)
        have = [self.feedback.residual(e.name) for e in bucket.entries]
        fits = [r is not None and r.shape == x.shape and r.dtype == x.dtype
                for r, x in zip(have, xs)]
        for e, x, q, ok in zip(bucket.entries, xs, sent, fits):
            if not ok:  # the first compressed step: new residuals
                self.feedback.update(e.name, x, q)
        rs = [r for r, ok in zip(have, fits) if ok and r is not None]
        if rs:  # torch.sub(x, q, out=r) for each, in two ops
            torch._foreach_copy_(rs, [x for x, ok in zip(xs, fits) if ok])
            torch._foreach_sub_(rs, [q for q, ok in zip(sent, fits) if ok])

    def state_dict(self) -> dict[str, Any]:
        return {"feedback": self.feedback.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.feedback.load_state_dict(state["feedback"])

    # -- facts the cost model prices ---------------------------------------------------
    @property
    def granularity(self) -> str:
        return "bucket"  # each bucket's momentum is compressed whole

    def wire_messages(self, bucket: Sequence[TensorSpec], world: int, rank: int
                      ) -> list[Message]:
        """Allreduce while the optimizer warms up (set up and not frozen yet; not set up:
        the steady state), then the whole bucket's payload: allreduced where it sums
        element-wise, else allgathered (its encoder keeps the residual exact)."""
        opt = getattr(self, "optimizer", None)
        if opt is not None and not opt.frozen:
            return allreduce_messages(self, bucket, world, rank)
        payload = payload_of(self.compressor, (sum(t.numel for t in bucket),))
        if self.compressor.aggregation is Aggregation.SUM and \
                self.compressor.payload_sums_elementwise:
            return [Message("allreduce", ring_sent(t.numel() * t.element_size(), world))
                    for t in payload.tensors]
        return [Message("allgather", (world - 1) * payload.nbytes)]

    def own_work_cost(self, sizes: Shapes, device: torch.device | str = "cpu") -> TreeCost:
        """The momentum arithmetic (:func:`hexagram.cost.own_work.qadam_own_cost`)."""
        return qadam_own_cost(self, sizes, device=device)
