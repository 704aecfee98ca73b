"""gTop-k S-SGD (Shi et al., ICDCS 2019): only the k globally largest entries are applied.

Each segment (gradient + residual) keeps its local top ``k = density * numel`` (``topk``
compressor); :func:`hexagram.comm.gtopk.gtopk_allreduce` merges the ranks' pairs on a tree
(log2 P rounds of k pairs, summing shared indices and keeping the top k), and rank 0's final
``k`` pairs are broadcast (for a power-of-two P, recursive doubling computes the same pairs
on every rank in half the sequential messages), so every rank applies the same sparse mean
with exactly ``k`` entries. Every local value the global result does not include stays in
the residual (error feedback), so the sum of what was applied and what every rank still
holds is exactly the sum of all gradients.

Fixed against the paper's bookkeeping: the paper (Algorithm 3) clears each locally selected
index that won globally, but an index that wins is applied with the values that survived
the tree's merges only; a rank's value for it dropped in an early merge was then lost for
good (at density 0.01 on 4 ranks, digits MLP: 78.2% against 91.5% for allreduce).
:func:`~hexagram.comm.gtopk.gtopk_allreduce_tracked` says which of a rank's values the
result includes, at no extra bytes, and only those leave the residual.

A bucket's tensors go together (:mod:`hexagram.comm.gtopk_segments`): each keeps its own
global top-k, but their pairs ride in one message per tree edge (the same bytes), are
selected by one ``compress_segments`` call and merged by a fixed number of ops, and the
residuals are one buffer per bucket layout: a step's ops do not grow with the number of
tensors. (A bucket holding an empty tensor, or 2**31 elements or more, goes tensor by
tensor, :meth:`GTopKAlgorithm.reduce_segment`.)

No host reads per segment: the selections are fixed-size (``k`` pairs in and out, masks
applied by ``torch.where`` and scatters), and the range check of this rank's indices and
the checks of every message received (a peer's bytes: a malformed one is made harmless,
:mod:`hexagram.comm.gtopk_tree`) join the step's one read (``ctx.checks``). The ranks
agree on a malformed message with one 8-byte allreduce per step, after the last bucket's
exchange (:class:`~hexagram.comm.gtopk_tree.StepFaults`, closed in :meth:`after_backward`),
not one per bucket: every rank raises :class:`~hexagram.errors.MalformedPayloadError` at
the same step, naming the sender (or skips it under ``on_nonfinite="skip"``).

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("gtopk", density=0.001).config.density
    0.001
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hexagram import compress
from hexagram.algorithms.compressed import (
    CompressedAlgorithm,
    CompressedConfig,
    Segment,
)
from hexagram.algorithms.layouts import BucketLayout, LayoutCache
from hexagram.buckets import Bucket
from hexagram.comm.communicator import Handle
from hexagram.comm.gtopk import (
    butterfly,
    gtopk_allreduce_tracked,
    gtopk_bytes,
    sparse_pairs,
)
from hexagram.comm.gtopk_segments import SegmentPlan, gtopk_allreduce_segments
from hexagram.comm.gtopk_tree import StepFaults
from hexagram.compress.feedback import ErrorFeedback
from hexagram.compress.segments import Segments
from hexagram.config import check_float
from hexagram.cost.facts import Shapes
from hexagram.cost.own_work import gtopk_tree_cost
from hexagram.cost.profile import TreeCost
from hexagram.cost.schedule import Message, TensorSpec, payload_of, ring_sent, segment_shapes

__all__ = ["GTopKAlgorithm", "GTopKConfig", "sparse_pairs"]


@dataclass(frozen=True, kw_only=True)
class GTopKConfig(CompressedConfig):
    """Config of :class:`GTopKAlgorithm` (plus :class:`CompressedConfig`'s fields).

    Attributes:
        approximate: estimate the top-k threshold from a sample (DGC's trick): faster on
            large tensors, same selection (falls back to exact top-k when it misses); on
            by default: ``torch.topk`` over a 10M-element gradient costs about 5x more.
        density: fraction of elements applied per segment and step; lower => fewer bytes,
            slower convergence. The global k is applied *once*, not once per rank as top-k's
            union, so gTop-k needs about P times top-k's density for the same progress: 0.05
            is a drop-in at SGD lr 0.05, momentum 0.9 on digits with 4 ranks (1.3 points
            below allreduce; 0.04: 1.8, 0.03: 2.5, 0.01: 12.9). The paper's 0.001 is for
            long runs of large models, where it pays back in bytes.
        error_feedback: keep what was not applied for the next step (on, as the paper).
    """

    algorithm = "gtopk"

    density: float = 0.05
    approximate: bool = True
    error_feedback: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float(self, "density", low=0.0, high=1.0, low_open=True)


@dataclass(frozen=True, eq=False)  # one per bucket layout, a key of the flat residual
class _Layout(BucketLayout):
    """A bucket layout's host facts, built once: its tensors' segments (whole bucket for
    ``granularity="bucket"``: always segments) and their pairs (``plan``)."""

    segments: Segments
    plan: SegmentPlan = field(kw_only=True)


class GTopKAlgorithm(CompressedAlgorithm):
    """Global top-k by gTopKAllReduce with error feedback; see :class:`GTopKConfig`."""

    name = "gtopk"
    own_work = "tree"  # sort, merge rounds, the result written: replaces the decodes

    def __init__(self, config: GTopKConfig | None = None) -> None:
        super().__init__(config or GTopKConfig())
        self.config: GTopKConfig
        self.compressor = compress.get("topk", density=self.config.density,
                                       approximate=self.config.approximate)
        self.compressor.checks_finite = False  # buckets are checked once per step instead
        if self.config.error_feedback:
            self.error_feedback = ErrorFeedback(self.compressor)
        self._layouts: LayoutCache[_Layout] = LayoutCache()
        self._faults: StepFaults | None = None  # this step's exchanges' (see the module doc)

    def _step_faults(self) -> StepFaults | None:
        """This step's :class:`StepFaults` (made at its first exchange); None alone."""
        if self.ctx.comm.size == 1:
            return None
        if self._faults is None:
            self._faults = StepFaults(self.ctx.comm, self.ctx.checks.add)
        return self._faults

    def after_backward(self) -> None:
        """The step's one agreement on the messages received (submitted after its last
        exchange; its flag joins the step's checks), then the checks as every algorithm."""
        faults, self._faults = self._faults, None
        if faults is not None:
            faults.close()
        super().after_backward()

    def reduce_bucket(self, bucket: Bucket) -> Handle[Tensor]:
        """The bucket's tensors in one exchange (see the module doc), into ``bucket.flat``;
        tensor by tensor where a layout cannot go whole."""
        layout = self._layouts.of(bucket, self._build_layout)
        if layout is None:
            return super().reduce_bucket(bucket)
        flat, plan, ef = bucket.flat, layout.plan, self.error_feedback
        bound = None if ef is None else ef.bind_flat(layout, layout.names, layout.lengths, flat)
        if bound is not None and not bound.zero:  # a zero residual is not added, as alone
            flat.add_(bound.buffer)
        payload = self.compressor.compress_segments(flat, layout.segments, self.generator)
        values, indices = sparse_pairs(payload)
        checks, size = self.ctx.checks, self.ctx.comm.size
        handle = gtopk_allreduce_segments(self.ctx.comm, values, indices, plan,
                                          checks=checks.add, step=self._step_faults())

        def finish(result: tuple[Tensor, Tensor, Tensor]) -> Tensor:
            gvalues, gindices, included = result
            if bound is not None:  # my values the global sum includes leave the residual
                mine = flat.index_select(0, indices)
                kept = torch.where(included, torch.zeros_like(mine), mine)
                bound.buffer.copy_(flat).scatter_(0, indices, kept)
                bound.zero = False
            if size > 1:  # every message received was checked (gtopk_tree.Receipts):
                gindices = gindices.clamp(0, plan.numel - 1)  # kept in range regardless
            return flat.zero_().index_put_((gindices,), gvalues / size)

        return handle.then(finish)

    def _build_layout(self, bucket: Bucket, names: tuple[str, ...],
                      lengths: tuple[int, ...]) -> _Layout | None:
        """The bucket's layout; None where it goes tensor by tensor (an empty tensor,
        2**31 elements or more)."""
        if min(lengths) == 0 or sum(lengths) >= 2**31:
            return None
        sizes = lengths if self.config.granularity == "layer" else (sum(lengths),)
        plan = SegmentPlan.of(sizes, [self.compressor.config.count(n) for n in sizes])
        return _Layout(bucket.entries, names, lengths, Segments.of(sizes), plan=plan)

    def reduce_segment(self, segment: Segment, tensor: Tensor) -> Handle[Tensor]:
        """Top-k of ``tensor`` + residual (built in ``tensor``, the bucket's own view), the
        global top-k by gTopKAllReduce, written back into ``tensor`` (mean over ranks)."""
        feedback = self.error_feedback is not None
        if feedback:
            self.correct_(segment, tensor)
        values, indices = sparse_pairs(self.compressor.compress(tensor, self.generator))
        checks = self.ctx.checks
        handle = gtopk_allreduce_tracked(self.ctx.comm, values, indices, segment.numel,
                                         checks=checks.add, step=self._step_faults())
        size, numel = self.ctx.comm.size, segment.numel

        def finish(results: list[tuple[Tensor, Tensor, Tensor]]) -> Tensor:
            gvalues, gindices, included = results[0]
            if feedback:  # sent = my values the global sum includes; the rest stays
                self._keep_residual(segment, tensor, indices, included)
            if size > 1:  # every message received was checked (gtopk_tree.Receipts):
                gindices = gindices.clamp(0, numel - 1)  # kept in range regardless
            return tensor.zero_().index_put_((gindices,), gvalues / size)

        return Handle.gather([handle], "gtopk").then(finish)

    def _keep_residual(self, segment: Segment, acc: Tensor, indices: Tensor,
                       included: Tensor) -> None:
        """Residuals := ``acc`` with the ``included`` entries of ``indices`` (segment
        indices, distinct) zeroed: a scatter of ``k`` values, no host read."""
        ef = self._feedback()
        mine = acc.index_select(0, indices)
        zero = torch.zeros_like(mine)
        if len(segment.entries) == 1:
            residual = ef.residual_buffer(segment.entries[0].name, acc)
            residual.copy_(acc).view(-1).scatter_(0, indices, torch.where(included, zero, mine))
            return
        counted = torch.zeros_like(acc).scatter_(0, indices, torch.where(included, mine, zero))
        self.update(segment, acc, counted)

    # -- facts the cost model prices ---------------------------------------------------
    def wire_messages(self, bucket: Sequence[TensorSpec], world: int, rank: int
                      ) -> list[Message]:
        """The bucket's pairs (every segment's together, one message per edge) up and down
        the tree: recursive doubling (P a power of two) takes ``log2 P`` exchanges;
        otherwise a binomial tree up and the result broadcast down it, ``2 ceil(log2 P)``
        sequential rounds (the step's 8-byte fault allreduce: :meth:`step_messages`)."""
        depth = max(1, math.ceil(math.log2(world)))
        rounds = depth if butterfly(world) else 2 * depth
        values = [payload_of(self.compressor, s).tensors[0]
                  for s in segment_shapes(self, bucket)]
        if not values:
            return []
        up, down = gtopk_bytes(rank, world, sum(v.numel() for v in values),
                               values[0].element_size())
        return [Message("pair", up + down, rounds=rounds)]

    def step_messages(self, world: int, rank: int) -> list[Message]:
        """After the last bucket: the step's one 8-byte fault allreduce (every rank learns
        of a malformed message some rank received, :class:`StepFaults`)."""
        return [Message("allreduce", ring_sent(8, world))]

    def own_work_cost(self, sizes: Shapes, device: torch.device | str = "cpu") -> TreeCost:
        """The tree's own CPU (:func:`hexagram.cost.own_work.gtopk_tree_cost`)."""
        return gtopk_tree_cost(self, sizes, device=device)

    def gathered_decodes(self, world: int) -> int:
        """One merge per round of the tree (``ceil(log2 P)``) and the result once."""
        return min(world, math.ceil(math.log2(world)) + 1) if world > 1 else world
