"""What the compressed-gradient algorithms share: config fields, segments, checks, state.

A compressed-gradient algorithm receives each ready bucket, checks it for NaN/Inf (before
anything is compressed, naming the step and the parameter), cuts it into *segments* (one per
tensor with ``granularity="layer"``, the whole bucket with ``granularity="bucket"``: Dutta
et al.'s layer-wise vs whole-model compression), reduces each segment with
:meth:`CompressedAlgorithm.reduce_segment` and joins the results into the bucket's flat
gradient. Subclasses only say how a segment is reduced.

Per-tensor state (error-feedback residuals, momenta) is kept per parameter *name*, so it
survives the engine re-forming buckets after the first step; a bucket-granularity segment's
residual is the concatenation of its tensors' residuals. Residuals live in a
:class:`hexagram.compress.ErrorFeedback` keyed by parameter name.

Example (a subclass; :class:`CompressorAlgorithm` picks the collective from the
compressor's aggregation)::

    class TopK(CompressorAlgorithm):
        name = "topk"
        def __init__(self, config):
            super().__init__(config)
            self.use_compressor(hexagram.compress.get("topk", density=0.01), feedback=True)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.buckets import Bucket, BucketEntry
from hexagram.comm import primitives
from hexagram.comm.communicator import Handle
from hexagram.compress.base import Aggregation, Compressor, Payload, all_finite
from hexagram.compress.combine import sum_payloads
from hexagram.compress.feedback import ErrorFeedback
from hexagram.config import check_choice, check_int
from hexagram.errors import NonFiniteGradientError

__all__ = [
    "GRANULARITIES",
    "NONFINITE_POLICIES",
    "CompressedAlgorithm",
    "CompressedConfig",
    "CompressorAlgorithm",
    "Segment",
    "check_finite",
    "gather_state",
    "mean_of",
    "scatter_state",
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
        on_nonfinite: ``"raise"`` stops with :class:`NonFiniteGradientError` naming the step
            and parameter; ``"skip"`` makes every rank agree (one tiny allreduce per bucket)
            and apply a zero gradient for that bucket instead (the whole step when the model
            fits one bucket; the optimizer still steps, so momentum and weight decay act).
        seed: seeds this algorithm's random generator (stochastic rounding, random-k).
    """

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


def gather_state(store: dict[str, Tensor], segment: Segment, like: Tensor) -> Tensor:
    """Per-name state of the segment's tensors, concatenated (zeros where absent), 1-D."""
    parts = [store.get(e.name) for e in segment.entries]
    return torch.cat([p if p is not None else like.new_zeros(e.numel)
                      for p, e in zip(parts, segment.entries)])


def scatter_state(store: dict[str, Tensor], segment: Segment, value: Tensor) -> None:
    """Store a segment's 1-D state split per tensor name (copies, so buffers can change)."""
    offset = 0
    for e in segment.entries:
        store[e.name] = value[offset:offset + e.numel].detach().clone()
        offset += e.numel


def _spans(segment: Segment) -> list[tuple[BucketEntry, int, int]]:
    """Each tensor of the segment with its [start, stop) inside the segment."""
    return [(e, e.offset - segment.start, e.offset - segment.start + e.numel)
            for e in segment.entries]


def mean_of(tensors: Sequence[Tensor]) -> Tensor:
    """Element-wise mean, summed in rank order (identical on every rank)."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total.add_(t)
    return total.div_(len(tensors))


class CompressedAlgorithm(Algorithm):
    """Base of the compressed-gradient algorithms (``kind = "grad"``).

    Subclasses implement :meth:`reduce_segment` (return a handle of the *averaged* segment)
    and may extend :meth:`state_dict`. ``self.step`` counts backward passes that
    communicated; ``self.error_feedback`` (set by subclasses that use it) holds the
    error-feedback residuals, one per parameter name.
    """

    kind = "grad"

    def __init__(self, config: CompressedConfig) -> None:
        super().__init__(config)
        self.config: CompressedConfig
        self.step = 0
        self.skipped_steps = 0
        self.error_feedback: ErrorFeedback | None = None
        self.generator = torch.Generator()
        self.reduce_generator = torch.Generator()
        self._shared_seed = False  # subclasses whose ranks must draw the same numbers set it
        self._generator_loaded = False
        self._last_skipped = -1

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        # Independent noise per rank (stochastic rounding) unless the method needs shared
        # randomness (random-k with the same indices everywhere).
        if not self._generator_loaded:
            offset = 0 if self._shared_seed else ctx.comm.rank
            self.generator = torch.Generator(device=ctx.runtime.device)
            self.generator.manual_seed(self.config.seed * 1_000_003 + offset)
            # draws made on the communicator's thread (scatter-gather's second leg) use
            # their own generator, so their order never depends on thread timing
            self.reduce_generator = torch.Generator(device=ctx.runtime.device)
            self.reduce_generator.manual_seed(self.config.seed * 1_000_003 + offset + 500_009)

    # -- the hook ------------------------------------------------------------------------
    def bucket_ready(self, bucket: Bucket) -> Handle[Tensor]:
        problem = check_finite(bucket, self.step, self.name)
        if self.config.on_nonfinite == "skip":
            if self._any_rank_bad(problem is not None):
                log.warning("%s: skipping step %d (%s)", self.name, self.step,
                            problem or "non-finite gradient on another rank")
                if self._last_skipped != self.step:  # count steps, not buckets
                    self.skipped_steps += 1
                    self._last_skipped = self.step
                return Handle.completed(torch.zeros_like(bucket.flat), f"{self.name}.skip")
        elif problem is not None:
            raise NonFiniteGradientError(problem)
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

    def _any_rank_bad(self, bad: bool) -> bool:
        flag = torch.tensor([1.0 if bad else 0.0], device=self.ctx.runtime.device)
        return bool(primitives.allreduce(self.ctx.comm, flag, average=False).wait().item() > 0)

    def reduce_segment(self, segment: Segment, tensor: Tensor) -> Handle[Tensor]:
        """Start reducing one segment (1-D view of the bucket); the handle gives the mean."""
        raise NotImplementedError(f"{type(self).__name__} must implement reduce_segment "
                                  "or reduce_bucket")

    def after_backward(self) -> None:
        self.step += 1

    # -- helpers for subclasses ----------------------------------------------------------
    def _feedback(self) -> ErrorFeedback:
        if self.error_feedback is None:
            raise RuntimeError(f"{self.name}: error feedback is off in this configuration")
        return self.error_feedback

    def correct(self, segment: Segment, tensor: Tensor) -> Tensor:
        """``tensor`` (the segment, 1-D) plus each of its tensors' residual: a new tensor."""
        ef = self._feedback()
        return torch.cat([ef.correct(e.name, tensor[a:b]) for e, a, b in _spans(segment)])

    def correct_(self, segment: Segment, tensor: Tensor) -> Tensor:
        """:meth:`correct` in place: ``tensor`` (the algorithm's own buffer) += residuals."""
        ef = self._feedback()
        for e, a, b in _spans(segment):
            ef.correct_(e.name, tensor[a:b])
        return tensor

    def update(self, segment: Segment, corrected: Tensor, sent: Tensor) -> None:
        """Residuals of the segment's tensors := ``corrected - sent`` (both 1-D), written
        into the old residuals' memory."""
        ef = self._feedback()
        for e, a, b in _spans(segment):
            ef.update_(e.name, corrected[a:b], sent[a:b])

    def compress_with_feedback(self, segment: Segment, tensor: Tensor,
                               compressor: Compressor) -> Payload:
        """Compress ``tensor`` (+ residual, if error feedback is on); keep what was lost.

        Invariant (Karimireddy et al. 2019): ``sent + new residual == tensor + old residual``
        where ``sent = decompress(payload)``. With error feedback ``tensor`` (the segment's
        view of the bucket, the algorithm's own buffer) receives the residual in place, and
        the new residual is decoded into the old one's memory: no gradient-sized temporaries.
        """
        if self.error_feedback is None:
            return compressor.compress(tensor, self.generator)
        ef, spans = self._feedback(), _spans(segment)
        payload = compressor.compress(self.correct_(segment, tensor), self.generator)
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
    """A compressor applied per segment, exchanged the way its payloads combine.

    The compressor's :attr:`~hexagram.compress.base.Compressor.aggregation` picks the
    collective: ``SUM`` -> allreduce of the payloads; ``SCATTER_GATHER`` -> scatter-gather
    (compress, all-to-all, reduce, compress, allgather), unless error feedback is on;
    ``GATHER`` (or ``SCATTER_GATHER`` with error feedback, which needs the exact local
    compression error) -> allgather of payloads, then :meth:`aggregate_payloads`.

    Subclasses set ``name`` and call :meth:`use_compressor` in ``__init__``.
    """

    compressor: Compressor

    def use_compressor(self, compressor: Compressor, feedback: bool) -> None:
        """Set the compressor, wrapped in error feedback if ``feedback``."""
        self.compressor = compressor
        self.error_feedback = ErrorFeedback(compressor) if feedback else None

    def reduce_bucket(self, bucket: Bucket) -> Handle[Tensor]:
        """Layer-wise segments of scatter-gather and gather formats go out coalesced: each
        tensor is compressed on its own, and all of a bucket's payloads travel in one
        message per leg (same payloads, bytes and draws as one collective per tensor)."""
        segs = segments(bucket, self.config.granularity)
        comp, feedback = self.compressor, self.error_feedback is not None
        custom = type(self).reduce_segment is not CompressorAlgorithm.reduce_segment
        if len(segs) == 1 or custom or comp.aggregation is Aggregation.SUM:
            return super().reduce_bucket(bucket)
        views = [bucket.flat[s.start:s.stop] for s in segs]
        if comp.aggregation is Aggregation.SCATTER_GATHER and not feedback:
            return primitives.scatter_gather_many(
                self.ctx.comm, views, comp, generator=self.generator,
                reduce_generator=self.reduce_generator, outs=views
            ).then(lambda _: bucket.flat)
        payloads = [self.compress_with_feedback(s, v, comp) for s, v in zip(segs, views)]

        def combine(per_tensor: list[list[Payload]]) -> Tensor:
            for view, payloads_of_all in zip(views, per_tensor):
                result = self.aggregate_payloads(payloads_of_all, view)
                if result.data_ptr() != view.data_ptr():
                    view.copy_(result.reshape(-1))
            return bucket.flat

        return primitives.allgather_payloads_many(self.ctx.comm, payloads).then(combine)

    def reduce_segment(self, segment: Segment, tensor: Tensor) -> Handle[Tensor]:
        """Reduce ``tensor`` (the segment's view of the bucket); the mean is written into it
        (the input is fully compressed before any result arrives)."""
        comm, comp = self.ctx.comm, self.compressor
        feedback = self.error_feedback is not None
        if comp.aggregation is Aggregation.SUM:
            if not feedback:
                return primitives.allreduce_compressed(comm, tensor, comp)
            return self._sum_payload(self.compress_with_feedback(segment, tensor, comp), tensor)
        if comp.aggregation is Aggregation.SCATTER_GATHER and not feedback:
            return primitives.scatter_gather(comm, tensor, comp, generator=self.generator,
                                             reduce_generator=self.reduce_generator, out=tensor)
        payload = self.compress_with_feedback(segment, tensor, comp)
        h = primitives.allgather_payloads(comm, payload)
        return h.then(lambda payloads: self.aggregate_payloads(payloads, tensor))

    def _sum_payload(self, payload: Payload, out: Tensor) -> Handle[Tensor]:
        """Allreduce (sum) a summable payload's tensors in place; decode into ``out``, / P."""
        handles = [primitives.allreduce(self.ctx.comm, t, average=False)
                   for t in payload.tensors]
        size = self.ctx.comm.size
        return Handle.gather(handles, f"{self.name}.sum").then(
            lambda _: self.compressor.decompress_into(payload, out).div_(size))

    def aggregate_payloads(self, payloads: list[Payload], out: Tensor) -> Tensor:
        """Combine every rank's payload (rank order) into ``out`` (the segment, 1-D, free to
        overwrite) and return it; default: the mean, each payload decoded and added straight
        into ``out`` (no dense temporary per rank), summed in rank order as :func:`mean_of`.
        """
        size = len(payloads)
        if sum_payloads(self.compressor, payloads, out, lambda t: t.div_(size)) is not None:
            return out  # summed in code space (few-bit formats): same values, fewer passes
        for i, p in enumerate(payloads):
            self.compressor.decompress_into(p, out, add=i > 0)
        return out.div_(size)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.compressor.load_state_dict(state["compressor"])
