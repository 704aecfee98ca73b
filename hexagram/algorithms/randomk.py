"""Random-k sparsification: the same ``k`` random positions on every rank, error feedback.

Ranks draw the positions from generators seeded identically (``seed``), so slot ``i`` of
every rank's payload holds the same element: only the ``k`` values cross the wire, summed by
a ring allreduce (``2 (P-1)/P * k`` values per rank instead of ``(P-1) k`` (index, value)
pairs for an allgather), and each rank rebuilds the mean with its own copy of the indices.
By default the values are rescaled by ``1 / density`` (an unbiased estimate of the mean
gradient) and the optimizer keeps its momentum, which averages the estimates. With
``error_feedback=True`` they are sent unscaled and the unsent values stay in a residual;
the optimizer's SGD momentum is then taken over as momentum correction (:mod:`~hexagram.
algorithms.momentum_correction`, as DGC does), so the residual accumulates the velocity
rather than stale gradients that the optimizer's momentum would amplify.

Measured (Fashion-MNIST, 4 ranks, MLP 784-128-10, SGD lr 0.05 momentum 0.9, batch 128 per
rank, 5 epochs; allreduce 85.46 %; ``benchmarks/delay_convergence.py images --delays 0``):

=============================================  ==============  ==============
configuration                                  density 0.25    density 0.5
=============================================  ==============  ==============
error feedback, under the optimizer's momentum 56.5 %          -
error feedback + momentum correction           64.9 %          78.4 %
unbiased (rescaled), optimizer's momentum      82.9 %          **85.6 %**
=============================================  ==============  ==============

A coordinate waits ``1 / density`` steps on average for its turn, so with feedback the
update is a randomly delayed one, which heavy-ball momentum at this learning rate does not
tolerate (docs/benchmarks/delay.md gives the one-step case); the unbiased estimate is
never late, only noisier (variance ``1 / density - 1`` times the squared mean gradient,
averaged by the momentum). Hence the defaults: unbiased, density 0.5 (half of
allreduce's values). Random-k is not an ``auto`` candidate: PowerSGD, top-k and the
quantizers send far less for the same accuracy.

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("randomk", density=0.1).config.density
    0.1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from hexagram import compress
from hexagram.algorithms.compressed import (
    BucketLayout,
    CompressedConfig,
    CompressorAlgorithm,
    segments,
)
from hexagram.algorithms.momentum_correction import MomentumCorrection, entry_part
from hexagram.buckets import Bucket
from hexagram.comm.communicator import Handle
from hexagram.comm.gtopk import sparse_pairs
from hexagram.comm.reduce import reduce_many
from hexagram.compress.base import Payload
from hexagram.config import check_float
from hexagram.cost.schedule import Message, TensorSpec, payload_of, ring_sent, segment_shapes

__all__ = ["RandomKAlgorithm", "RandomKAlgorithmConfig"]


@dataclass(frozen=True, kw_only=True)
class RandomKAlgorithmConfig(CompressedConfig):
    """Config of :class:`RandomKAlgorithm` (plus :class:`CompressedConfig`'s fields).

    Attributes:
        density: fraction of elements sent per segment; lower => fewer bytes, noisier
            steps. 0.5 (default) is a drop-in with SGD(lr 0.05, momentum 0.9): within
            0.2 point of allreduce on Fashion-MNIST (module doc), 0.25 2.5 points below.
        error_feedback: off (default): values rescaled by ``1 / density`` (unbiased); on:
            unscaled, the unsent ones kept for the next step (momentum correction, below).
        momentum: momentum correction, used with ``error_feedback=True``; None => the
            optimizer's SGD momentum taken over (with feedback; module doc); a number =>
            this one, for a momentum-free optimizer.
    """

    algorithm = "randomk"

    density: float = 0.5
    error_feedback: bool = False
    momentum: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float(self, "density", low=0.0, high=1.0, low_open=True)
        if self.momentum is not None:
            check_float(self, "momentum", low=0.0, high=1.0, high_open=True)


class RandomKAlgorithm(MomentumCorrection, CompressorAlgorithm):
    """Shared-seed random-k with error feedback and momentum correction; see
    :class:`RandomKAlgorithmConfig`."""

    name = "randomk"
    shared_randomness = True  # the same positions on every rank

    def __init__(self, config: RandomKAlgorithmConfig | None = None) -> None:
        super().__init__(config or RandomKAlgorithmConfig())
        self.config: RandomKAlgorithmConfig
        # Unscaled values: error feedback keeps the rest. (Rescaling by n/k makes the
        # estimate unbiased but the residual would then grow without bound.)
        self.use_compressor(compress.get("randomk", density=self.config.density,
                                         seed=self.config.seed,
                                         rescale=not self.config.error_feedback),
                            self.config.error_feedback)

    def takes_momentum_over(self) -> bool:
        """Only with error feedback: unbiased estimates are averaged by the optimizer's
        own momentum (module doc)."""
        return self.config.error_feedback

    def reduce_bucket(self, bucket: Bucket) -> Handle[Tensor]:
        """The bucket's velocities with feedback, then only the values: one draw for the
        bucket (every tensor its own k), summed by one allreduce (slot i is the same
        element on every rank), decoded into the bucket with this rank's positions."""
        if self.factors or self.config.momentum:
            for s in segments(bucket, self.config.granularity):
                v = bucket.flat[s.start:s.stop]
                for e, u in zip(s.entries, self.velocities(s, v)):  # u replaces the gradient
                    entry_part(s, v, e).copy_(u)
        layout = self.layout(bucket)
        payload = self.encode_bucket(layout, bucket.flat, 1)
        values = sparse_pairs(payload)[0]  # the payload's own tensor
        return reduce_many(self.ctx.comm, [values], None, outs=[values]).then(
            lambda _: self._decode(payload, layout, bucket.flat))

    def _decode(self, payload: Payload, layout: BucketLayout, flat: Tensor) -> Tensor:
        if layout.segments is None:
            return self.compressor.decompress_into(payload, flat)
        return self.compressor.decompress_segments_into(payload, flat)

    def wire_messages(self, bucket: Sequence[TensorSpec], world: int, rank: int
                      ) -> list[Message]:
        """Only the values cross the wire, one allreduce per bucket: the positions are
        the same on every rank."""
        values = [payload_of(self.compressor, s).tensors[0]
                  for s in segment_shapes(self, bucket)]
        return [Message("allreduce", ring_sent(sum(v.numel() * v.element_size()
                                                   for v in values), world))]
