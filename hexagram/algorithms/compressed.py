"""What the compressed-gradient algorithms share: config fields, segments, checks, state.

A compressed-gradient algorithm receives each ready bucket (already checked for NaN/Inf by
the engine, once per step: :class:`hexagram.engine.checks.FiniteGuard`), cuts it into
*segments* (one per
tensor with ``granularity="layer"``, the whole bucket with ``granularity="bucket"``: Dutta
et al.'s layer-wise vs whole-model compression) and reduces them into the bucket's flat
gradient: :class:`CompressorAlgorithm` through :func:`hexagram.comm.reduce.reduce_many`
(the collective follows the compressor), others segment by segment
(:meth:`CompressedAlgorithm.reduce_segment`: gTop-k's tree) or bucket by bucket (PowerSGD).

Per-tensor state (error-feedback residuals, momenta) is kept per parameter *name*, so it
survives the engine re-forming buckets after the first step; a bucket-granularity segment's
residual is the concatenation of its tensors' residuals. Residuals live in a
:class:`hexagram.compress.ErrorFeedback` keyed by parameter name.

An algorithm that only applies a compressor needs no class: it is a registry line
(:class:`hexagram.algorithms.recipe.Recipe`), e.g.::

    Entry.declared(Recipe("topk", "topk", "top-k pairs by allgather",
                          {"density": Option(0.01, "fraction sent", _DENSITY)},
                          error_feedback=True))
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.algorithms.layouts import BucketLayout, LayoutCache
from hexagram.buckets import Bucket, BucketEntry
from hexagram.comm.communicator import Handle
from hexagram.comm.reduce import reduce_many
from hexagram.compress.base import Compressor, Payload, all_finite
from hexagram.compress.feedback import ErrorFeedback
from hexagram.compress.segments import Segments
from hexagram.config import check_choice, check_int
from hexagram.errors import step_error

__all__ = [
    "GRANULARITIES",
    "NONFINITE_POLICIES",
    "BucketLayout",
    "CompressedAlgorithm",
    "CompressedConfig",
    "CompressorAlgorithm",
    "Segment",
    "check_finite",
    "segments",
]

log = logging.getLogger(__name__)

GRANULARITIES = ("layer", "bucket")
NONFINITE_POLICIES = ("raise", "skip")


@dataclass(frozen=True, kw_only=True)
class CompressedConfig:
    """Fields every compressed-gradient algorithm has.

    Attributes:
        granularity: ``"layer"`` compresses each tensor on its own (scales, norms and top-k
            per layer: usually more accurate); ``"bucket"`` compresses a whole bucket at once
            (whole-model with a large ``bucket_size_mb``: fewer, larger messages).
        on_nonfinite: a NaN/Inf gradient on any rank (found by the engine once per step,
            read at the optimizer step): ``"raise"`` stops every rank with
            :class:`NonFiniteGradientError` naming the step and parameter; ``"skip"``
            applies a zero gradient for the whole step instead (the optimizer still
            steps, so momentum and weight decay act). Either way every rank's reduced
            gradient holds Inf, so a ``torch.amp.GradScaler`` skips the step on every rank
            (the optimizer step, and this policy, never run) and lowers its scale.
        seed: seeds this algorithm's random generator (stochastic rounding, random-k).
    """

    #: the algorithm's registry name: validation errors name it (``algorithm 'fp16': ...``)
    algorithm: ClassVar[str] = ""
    granularity: str = "layer"
    on_nonfinite: str = "raise"
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice(self, "granularity", GRANULARITIES)
        check_choice(self, "on_nonfinite", NONFINITE_POLICIES)
        check_int(self, "seed", low=0)
        for f in dataclasses.fields(self):  # subclasses' switches (error_feedback, ...)
            if f.type in ("bool", bool):
                check_choice(self, f.name, (True, False))


@dataclass(frozen=True)
class Segment:
    """A part of a bucket compressed as one tensor: ``flat[start:stop]`` over ``entries``."""

    entries: tuple[BucketEntry, ...]
    start: int
    stop: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    @property
    def numel(self) -> int:
        return self.stop - self.start


def segments(bucket: Bucket, granularity: str) -> list[Segment]:
    """The bucket cut per tensor (``"layer"``) or kept whole (``"bucket"``)."""
    if granularity == "bucket":
        return [Segment(tuple(bucket.entries), 0, bucket.numel)]
    return [Segment((e,), e.offset, e.offset + e.numel) for e in bucket.entries]


def check_finite(bucket: Bucket, step: int, who: str) -> str | None:
    """``None`` if ``bucket.flat`` is finite, else a message naming the first bad tensor."""
    if all_finite(bucket.flat):  # one sum; the exact pass only if the sum is not finite
        return None
    for e in bucket.entries:
        t = bucket.view(e)
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if nan or inf:
            return (f"{who}: gradient of parameter '{e.name}' at step {step} holds {nan} NaN "
                    f"and {inf} Inf of {e.numel} values, detected before compression. Lower "
                    "the learning rate, clip gradients or use loss scaling; or pass "
                    "on_nonfinite='skip' to skip such steps")
    return f"{who}: non-finite gradient at step {step}"  # pragma: no cover - unreachable


def _spans(segment: Segment) -> list[tuple[BucketEntry, int, int]]:
    """Each tensor of the segment with its [start, stop) inside the segment."""
    return [(e, e.offset - segment.start, e.offset - segment.start + e.numel)
            for e in segment.entries]


class CompressedAlgorithm(Algorithm):
    """Base of the compressed-gradient algorithms (``kind = "grad"``).

    Subclasses implement :meth:`reduce_segment` (return a handle of the *averaged* segment)
    and may extend :meth:`state_dict`. ``self.step`` counts backward passes that
    communicated; ``self.error_feedback`` (set by subclasses that use it) holds the
    error-feedback residuals, one per parameter name.
    """

    kind = "grad"
    #: True where every rank must draw the same random numbers (random-k's shared
    #: positions); False: independent noise per rank (stochastic rounding)
    shared_randomness: ClassVar[bool] = False

    def __init__(self, config: CompressedConfig) -> None:
        super().__init__(config)
        self.config: CompressedConfig
        self.step = 0
        self.skipped_steps = 0
        self.error_feedback: ErrorFeedback | None = None
        self.generator = torch.Generator()
        self.reduce_generator = torch.Generator()
        self._generator_loaded = False

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        if not self._generator_loaded:
            offset = 0 if self.shared_randomness else ctx.comm.rank
            self.generator = torch.Generator(device=ctx.runtime.device)
            self.generator.manual_seed(self.config.seed * 1_000_003 + offset)
            # draws made on the communicator's thread (scatter-gather's second leg) use
            # their own generator, so their order never depends on thread timing
            self.reduce_generator = torch.Generator(device=ctx.runtime.device)
            self.reduce_generator.manual_seed(self.config.seed * 1_000_003 + offset + 500_009)

    # -- the hook ------------------------------------------------------------------------
    def bucket_ready(self, bucket: Bucket) -> Handle[Tensor]:
        # NaN/Inf never get here: the engine's once-per-step check (engine/checks.py
        # FiniteGuard) flags them on the device, makes the bucket finite and applies
        # ``on_nonfinite`` at the optimizer step (counting ``skipped_steps``)
        return self.reduce_bucket(bucket)

    def reduce_bucket(self, bucket: Bucket) -> Handle[Tensor]:
        """Reduce a checked bucket: by default segment by segment, into ``bucket.flat``.

        Segments are compressed before this returns, so the bucket's buffer is free to hold
        the results (as allreduce's is): no new bucket-sized tensor, no ``torch.cat``.
        """
        segs = segments(bucket, self.config.granularity)
        handles = [self.reduce_segment(s, bucket.flat[s.start:s.stop]) for s in segs]
        if len(handles) == 1:
            return handles[0]

        def join(parts: list[Tensor]) -> Tensor:
            for s, part in zip(segs, parts):
                view = bucket.flat[s.start:s.stop]
                if part.data_ptr() != view.data_ptr():  # not reduced in place: copy it in
                    view.copy_(part.reshape(-1))
            return bucket.flat

        return Handle.gather(handles, self.name).then(join)

    def reduce_segment(self, segment: Segment, tensor: Tensor) -> Handle[Tensor]:
        """Start reducing one segment (1-D view of the bucket); the handle gives the mean."""
        raise NotImplementedError(f"{type(self).__name__} must implement reduce_segment "
                                  "or reduce_bucket")

    def after_backward(self) -> None:
        self.step += 1
        problem = self.ctx.checks.due()  # the step's one host read (none if none queued)
        if problem is not None:
            raise step_error(problem)

    # -- helpers for subclasses ----------------------------------------------------------
    def _feedback(self) -> ErrorFeedback:
        if self.error_feedback is None:
            raise RuntimeError(f"{self.name}: error feedback is off in this configuration")
        return self.error_feedback

    def correct_(self, segment: Segment, tensor: Tensor) -> Tensor:
        """``tensor`` (the segment, 1-D, the algorithm's own buffer) += each of its tensors'
        residual, in place; returns ``tensor``."""
        ef = self._feedback()
        for e, a, b in _spans(segment):
            ef.correct_(e.name, tensor[a:b])
        return tensor

    def update(self, segment: Segment, corrected: Tensor, sent: Tensor) -> None:
        """Residuals of the segment's tensors := ``corrected - sent`` (both 1-D), written
        into the old residuals' memory."""
        ef = self._feedback()
        for e, a, b in _spans(segment):
            ef.update(e.name, corrected[a:b], sent[a:b])

    def compress_with_feedback(self, segment: Segment, tensor: Tensor,
                               compressor: Compressor, divisor: int = 1) -> Payload:
        """The payload of ``(tensor + residual) / divisor``; keep what it lost.

        Invariant (Karimireddy et al. 2019): ``sent + new residual == tensor + old residual``
        where ``sent = divisor * decompress(payload)`` (``divisor``: the world size where
        the collective sums payloads of a mean, see :mod:`hexagram.comm.reduce`). Without
        error feedback this is the plain compression. ``tensor`` (the segment's view of the
        bucket, the algorithm's own buffer) receives the residual in place, and the new
        residual is decoded into the old one's memory: no gradient-sized temporaries.
        """
        if self.error_feedback is None:
            return compressor.compress(tensor.div_(divisor) if divisor > 1 else tensor,
                                       self.generator)
        ef, spans = self._feedback(), _spans(segment)
        self.correct_(segment, tensor)
        if divisor > 1:
            payload = compressor.compress(tensor / divisor, self.generator)
            self.update(segment, tensor, compressor.decompress(payload).reshape(-1)
                        .mul_(divisor))
            return payload
        payload = compressor.compress(tensor, self.generator)
        if len(spans) == 1:
            ef.update_from(spans[0][0].name, tensor, payload)
        else:  # several tensors' residuals: decode once, split
            self.update(segment, tensor, compressor.decompress(payload).reshape(-1))
        return payload

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "skipped_steps": self.skipped_steps,
                "feedback": None if self.error_feedback is None
                else self.error_feedback.state_dict(),
                "generator": self.generator.get_state(),
                "reduce_generator": self.reduce_generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        if self.error_feedback is not None:
            self.error_feedback.load_state_dict(state["feedback"])
        self.generator.set_state(state["generator"])
        self.reduce_generator.set_state(state["reduce_generator"])
        self._generator_loaded = True


class CompressorAlgorithm(CompressedAlgorithm):
    """A compressor applied per segment, exchanged by :func:`hexagram.comm.reduce.reduce_many`.

    The compressor's aggregation picks the collective there (one rule for every algorithm);
    a bucket goes out in one message per leg, decoded into the bucket. Layer-wise
    (``granularity="layer"``) the bucket's tensors are compressed in one
    :meth:`~hexagram.compress.base.Compressor.compress_segments` call and decoded in one
    call, and error feedback keeps one residual buffer per bucket layout
    (:meth:`~hexagram.compress.ErrorFeedback.compress_flat`): the ops a step adds do not
    grow with the number of tensors. With error feedback (or ``encodes_buckets``) the
    algorithm encodes the bucket itself (:meth:`encode_bucket`), which keeps scatter-gather
    formats on the allgather route.

    Subclasses set ``compressor`` (and ``error_feedback``) with :meth:`use_compressor`; they
    may set ``reduction = "majority"`` (signSGD's vote; layer-wise it goes segment by
    segment, each tensor's vote scaled on its own), override :meth:`encode_bucket` with
    ``encodes_buckets = True`` (fp16's range check, DGC's momentum correction and
    masking), or override :meth:`encode_segment` with ``custom_encoding = True``: such
    algorithms reduce segment by segment (:meth:`reduce_segments`); DeMo sets it and
    replaces :meth:`reduce_bucket` with its own flat path.
    """

    compressor: Compressor
    #: how the ranks' decoded segments combine: "mean", or "majority" (sign of the sum)
    reduction: ClassVar[str] = "mean"
    #: True where :meth:`encode_segment` does more than (error-feedback) compression: the
    #: bucket then goes segment by segment
    custom_encoding: ClassVar[bool] = False
    #: True where :meth:`encode_bucket` does more than (error-feedback) compression
    encodes_buckets: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._layouts: LayoutCache[BucketLayout] = LayoutCache()

    def use_compressor(self, compressor: Compressor, feedback: bool) -> None:
        """Set the compressor, wrapped in error feedback if ``feedback``."""
        self.compressor = compressor
        compressor.checks_finite = False  # the buckets are checked once per step instead
        self.error_feedback = ErrorFeedback(compressor) if feedback else None

    def reduce_bucket(self, bucket: Bucket) -> Handle[Tensor]:
        """The bucket in one compressed reduction: one payload per leg, decoded into
        ``bucket.flat`` (per segment for ``custom_encoding`` and layer-wise votes)."""
        layered = self.config.granularity == "layer"
        if self.custom_encoding or (layered and (self.reduction == "majority" or min(
                e.numel for e in bucket.entries) == 0)):
            return self.reduce_segments(bucket)
        layout = self.layout(bucket)
        own = self.error_feedback is not None or self.encodes_buckets
        return reduce_many(
            self.ctx.comm, [bucket.flat], self.compressor, reduction=self.reduction,
            outs=[bucket.flat], segments=[layout.segments],
            encode=(lambda _, t, d: self.encode_bucket(layout, t, d)) if own else None,
            generator=self.generator, reduce_generator=self.reduce_generator,
            faults=self.ctx.checks.add,
        ).then(lambda _: bucket.flat)

    def layout(self, bucket: Bucket) -> BucketLayout:
        """The bucket's :class:`BucketLayout` (built once per set of tensors: nothing per
        tensor is built after the first step)."""
        layout = self._layouts.of(bucket, self._build_layout)
        assert layout is not None  # the builder always gives one
        return layout

    def _build_layout(self, bucket: Bucket, names: tuple[str, ...],
                      lengths: tuple[int, ...]) -> BucketLayout:
        return BucketLayout(bucket.entries, names, lengths, Segments.of(lengths)
                            if self.config.granularity == "layer" else None)

    def encode_bucket(self, layout: BucketLayout, flat: Tensor, divisor: int) -> Payload:
        """The payload of ``flat / divisor`` (``flat``: the bucket's buffer, ours to
        change), its tensors compressed each on its own where ``layout.segments`` says so,
        with error feedback if on (sent + new residual == gradient + old residual)."""
        comp, ef = self.compressor, self.error_feedback
        if ef is not None:
            return ef.compress_flat(layout, layout.names, layout.lengths, flat,
                                    layout.segments, self.generator, divisor)
        if divisor > 1:
            flat.div_(divisor)
        if layout.segments is None:
            return comp.compress(flat, self.generator)
        return comp.compress_segments(flat, layout.segments, self.generator)

    def reduce_segments(self, bucket: Bucket) -> Handle[Tensor]:
        """Segment by segment (:meth:`encode_segment` per segment), one message per leg."""
        segs = segments(bucket, self.config.granularity)
        views = [bucket.flat[s.start:s.stop] for s in segs]
        own = self.error_feedback is not None or self.custom_encoding
        return reduce_many(
            self.ctx.comm, views, self.compressor, reduction=self.reduction, outs=views,
            encode=(lambda i, t, d: self.encode_segment(segs[i], t, d)) if own else None,
            generator=self.generator, reduce_generator=self.reduce_generator,
            faults=self.ctx.checks.add,
        ).then(lambda _: bucket.flat)

    def encode_segment(self, segment: Segment, tensor: Tensor, divisor: int) -> Payload:
        """The payload of ``tensor / divisor`` with error feedback (the default)."""
        return self.compress_with_feedback(segment, tensor, self.compressor, divisor)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.compressor.load_state_dict(state["compressor"])
