"""Deep Gradient Compression (Lin et al. 2018): top-k with momentum correction.

Per segment (a layer by default), with ``g`` the local gradient::

    g <- g * min(1, (clip_norm / sqrt(P)) / ||g||)   local gradient clipping (optional)
    u <- momentum * u + g                              momentum correction: momentum is
    v <- v + u                                         accumulated locally, before sparsifying
    send top-k(v) (allgather of (index, value) pairs, then the mean over ranks)
    v[sent] <- 0,  u[sent] <- 0 (masking=True)         momentum factor masking

The paper's momentum correction *replaces* the optimizer's momentum (its SGD update is
``w <- w - lr * mean(top-k(v))``, the velocity lives in ``u``), so DGC is a drop-in for the
user's optimizer by taking that momentum over: with ``momentum=None`` (the default), each
parameter of a ``torch.optim.SGD`` group with momentum ``m`` (no Nesterov, no dampening)
gets DGC momentum ``m`` and weight decay ``wd`` (added to ``g`` before ``u``, as SGD does
before its momentum buffer); that group then runs with momentum 0 and weight decay 0 until
the wrapper is closed (restored then), and a wrap-time warning says so. Parameters of any
other optimizer keep it untouched with DGC momentum 0 (top-k with error feedback under the
optimizer's own moments). An explicit ``momentum`` on top of an SGD momentum stacks the two:
about ``1 / (1 - momentum)`` times the effective step, warned with the lr factor
(:meth:`DGCAlgorithm.lr_note`); with a momentum-free ``SGD(lr)`` it is the paper's usage.

Momentum factor masking is off by default: it drops the velocity of every element sent,
which the paper introduced against staleness at 99.9% sparsity, where an element waits
about 1000 steps between sends; at density >= 0.01 the large elements are sent every few
steps and lose their momentum (at density 1 the update is plain SGD without momentum).
Without it, a gradient's total weight over the following steps is ``1 / (1 - m)`` as in
momentum SGD, and at density 1 DGC *is* the optimizer's momentum SGD, exactly. Measured
(digits MLP, 4 ranks, SGD lr 0.05 momentum 0.9 taken over, 8 epochs; allreduce 91.5%):
masking on 83.5% / 82.4% / 79.5% at density 0.01 / 0.02 / 0.05; off 88.4% / 90.4% at
0.01 / 0.02, hence the default density 0.02 (top-k's; DGC momentum 0 under the optimizer's
momentum: 89.5% / 90.7%).
Sparsity warm-up: for the first ``warmup_steps`` steps the density falls from
``warmup_density`` to ``density`` in four geometric stages (DGC's 75%, 93.75%, 98.4%,
99.6% sparsity for 0.25 -> 0.001), so early, fast-changing gradients are sent more densely.

Per bucket, not per tensor, and no host reads: clipping (one norm per segment by
``_foreach_norm``, one scale per element), the momentum update and ``v = u + residual`` are
a few whole-buffer ops (the velocities and the residuals of a bucket each live in one
buffer per bucket layout); the segments' top-k is one
:meth:`~hexagram.compress.base.Compressor.compress_segments` call (each tensor its own k),
exchanged as one payload; masking zeroes the sent entries of ``u`` by a gather and a
scatter of the ``k`` pairs (no boolean indexing) and the residual ``v - sent`` is a copy and
a scatter. Bit for bit the per-tensor arithmetic (``tests/test_dgc_takeover.py``).

Example:
    >>> import hexagram as hx
    >>> cfg = DGCConfig(density=0.01, warmup_steps=100)
    >>> round(density_at(cfg, 0), 4), round(density_at(cfg, 50), 4), density_at(cfg, 100)
    (0.25, 0.05, 0.01)
    >>> algo = hx.algorithms.get("dgc", density=0.01, warmup_steps=100)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hexagram import compress
from hexagram.algorithms.compressed import BucketLayout, CompressedConfig, CompressorAlgorithm
from hexagram.algorithms.momentum_correction import MomentumCorrection
from hexagram.buckets import Bucket
from hexagram.comm.communicator import Handle
from hexagram.compress.base import Compressor, Payload
from hexagram.compress.feedback import subtract_pairs

if TYPE_CHECKING:
    from hexagram.compress.feedback import _FlatResidual
from hexagram.config import check_choice, check_float, check_int

__all__ = ["DGCAlgorithm", "DGCConfig", "density_at"]

WARMUP_STAGES = 4


@dataclass(frozen=True, kw_only=True)
class DGCConfig(CompressedConfig):
    """Config of :class:`DGCAlgorithm` (plus :class:`CompressedConfig`'s fields).

    Attributes:
        approximate: estimate the top-k threshold from a sample (DGC's trick): faster on
            large tensors, same selection (falls back to exact top-k when it misses).
        density: fraction of elements sent per segment after warm-up; lower => fewer bytes
            (0.02: a drop-in on digits; the paper's 0.001 is for long, large runs).
        momentum: momentum of the correction; None => the optimizer's, taken over (module
            doc; a drop-in); a number => this one, for an optimizer without momentum
            (stacked on an optimizer's momentum it needs about ``1 - momentum`` times the
            lr, warned). Higher => smoother, larger accumulated updates.
        masking: momentum factor masking (zero ``u`` where sent, the paper's, for extreme
            sparsity); False (default) keeps the velocity of sent elements: at density 1
            DGC is exactly momentum SGD (module doc: measured).
        clip_norm: local clipping threshold of each segment's gradient norm, divided by
            sqrt(P) as in the paper; 0 => no clipping. Lower => more stable, slower.
        warmup_steps: steps of the sparsity warm-up; 0 => ``density`` from the start.
        warmup_density: density of the first warm-up stage (>= ``density``).
    """

    algorithm = "dgc"

    density: float = 0.02
    approximate: bool = True
    momentum: float | None = None
    masking: bool = False
    clip_norm: float = 0.0
    warmup_steps: int = 0
    warmup_density: float = 0.25

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float(self, "density", low=0.0, high=1.0, low_open=True)
        if self.momentum is not None:
            check_float(self, "momentum", low=0.0, high=1.0, high_open=True)
        check_choice(self, "masking", (True, False))
        check_float(self, "clip_norm", low=0.0)
        check_int(self, "warmup_steps", low=0)
        check_float(self, "warmup_density", low=self.density, high=1.0)


def density_at(config: DGCConfig, step: int) -> float:
    """Density at ``step``: four geometric stages from ``warmup_density``, then ``density``.

    >>> round(density_at(DGCConfig(density=0.01, warmup_steps=100), 50), 4)
    0.05
    """
    c = config
    if step >= c.warmup_steps:
        return c.density
    stage = step * WARMUP_STAGES // c.warmup_steps
    return c.warmup_density * math.exp(math.log(c.density / c.warmup_density)
                                       * stage / WARMUP_STAGES)


class DGCAlgorithm(MomentumCorrection, CompressorAlgorithm):
    """DGC's top-k with momentum correction (:class:`MomentumCorrection`), clipping,
    masking, warm-up; see :class:`DGCConfig`. A bucket is encoded whole
    (:meth:`encode_bucket`): its ops do not grow with its number of tensors."""

    name = "dgc"
    encodes_buckets = True
    #: the encoder picks its top-k per step (the density warm-up), not ``compressor``: a
    #: byte attack (:func:`hexagram.testing.attacks.corrupt_compressors`) corrupts what
    #: :meth:`encode_bucket` returns
    picks_compressor = True

    def __init__(self, config: DGCConfig | None = None) -> None:
        super().__init__(config or DGCConfig())
        self.config: DGCConfig
        self._by_density: dict[float, Compressor] = {}
        # the accumulated velocity v is DGC's error-feedback residual
        self.use_compressor(self._compressor(self.config.density), feedback=True)

    def density_at(self, step: int) -> float:
        """Density used at ``step`` (see :func:`density_at`)."""
        return density_at(self.config, step)

    def _compressor(self, density: float) -> Compressor:
        if density not in self._by_density:
            topk = compress.get("topk", density=density, approximate=self.config.approximate)
            topk.checks_finite = False  # buckets are checked once per step instead
            self._by_density[density] = topk
        return self._by_density[density]

    def reduce_bucket(self, bucket: Bucket) -> Handle[Tensor]:
        """Clip, update every ``u`` and build ``v = u + residual`` in the bucket's buffer
        (whole-buffer ops), then exchange it as one payload (:meth:`encode_bucket`)."""
        layout = self.layout(bucket)
        self._clip(layout, bucket.flat)
        residual = self._residuals(layout, bucket.flat)
        self.accumulate(layout, layout.entries, bucket.flat,
                        None if residual.zero else residual.buffer)
        return super().reduce_bucket(bucket)

    def _residuals(self, layout: BucketLayout, flat: Tensor) -> _FlatResidual:
        """The bucket's residuals as one buffer (bound once per layout)."""
        return self._feedback().bind_flat(layout, layout.names, layout.lengths, flat)

    def encode_bucket(self, layout: BucketLayout, flat: Tensor, divisor: int) -> Payload:
        """Encode top-k(v) of each segment of ``flat`` (the bucket's buffer, holding v since
        :meth:`reduce_bucket`) in one call, mask u where sent, keep v - sent as the
        residual; in place, no gradient-sized copies. Every rank's payload is decoded by
        any of our top-k compressors: decoding does not depend on the density.

        Raises ValueError for ``divisor != 1``: top-k is gathered, never summed.
        """
        if divisor != 1:
            raise ValueError(f"dgc: top-k payloads are gathered, never summed; got divisor "
                             f"{divisor} (route the bucket through an allgather)")
        comp = self._compressor(self.density_at(self.step))
        payload = comp.compress(flat, self.generator) if layout.segments is None \
            else comp.compress_segments(flat, layout.segments, self.generator)
        pairs = _pairs(payload)
        if self.config.masking:
            u = self.bind_velocities(layout, layout.entries, flat).buffer
            _mask(u, *pairs)
        residual = self._residuals(layout, flat)
        subtract_pairs(Payload(tensors=pairs, shape=flat.shape, dtype=flat.dtype),
                       flat, residual.buffer)  # v - sent: zero where sent
        residual.zero = False
        return payload

    def _clip(self, layout: BucketLayout, flat: Tensor) -> None:
        """Local gradient clipping of each segment, in place, to ``clip_norm / sqrt(P)``:
        ``g *= min(1, limit / ||g||)`` (the factor in float64, as a host float would be)."""
        if self.config.clip_norm <= 0:
            return
        limit = self.config.clip_norm / math.sqrt(self.ctx.comm.size)
        segs = layout.segments
        views = [flat] if segs is None else flat.split(segs.lengths)  # one op: views
        norms = torch.stack(torch._foreach_norm(views)).double()
        scale = (limit / norms).clamp_(max=1.0).to(flat.dtype)
        if segs is None or len(segs) == 1:
            flat.mul_(scale)
        else:
            flat.mul_(segs.expand(scale, flat.device))


def _pairs(payload: Payload) -> tuple[Tensor, Tensor]:
    """(values, bucket positions) of a top-k payload of a bucket, whole or segmented (a
    bucket of 2**31 elements or more comes in per-segment parts: shifted to the bucket)."""
    if "parts" not in payload.meta:
        values, positions = payload.tensors
        return values, positions
    segs = payload.meta["segments"]
    return (torch.cat(payload.tensors[0::2]),
            torch.cat([i.long() + o for i, o in zip(payload.tensors[1::2], segs.offsets)]))


def _mask(u: Tensor, values: Tensor, positions: Tensor) -> None:
    """Momentum factor masking: ``u := 0`` where a pair sends a non-zero value (where
    ``decompress(payload) != 0``), by a gather and a scatter of the ``k`` pairs (no
    boolean indexing: no host read)."""
    idx = positions.long()
    u.index_copy_(0, idx, u.index_select(0, idx).masked_fill_(values != 0, 0.0))
