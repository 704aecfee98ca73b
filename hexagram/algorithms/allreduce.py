"""Full-precision gradient allreduce, flat or hierarchical (BAGUA's gradient_allreduce).

Equivalent to PyTorch DDP: each bucket is divided by the world size and summed with an
allreduce as soon as its last gradient is ready, overlapping the rest of backward.

Example:
    >>> import hexagram as hx
    >>> algo = hx.algorithms.get("allreduce", hierarchical=False)
    >>> algo.config
    AllreduceConfig(hierarchical=False, average=True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.buckets import Bucket
from hexagram.comm import primitives
from hexagram.comm.communicator import Handle
from hexagram.comm.hierarchical import HostGroups, hierarchical_allreduce

__all__ = ["AllreduceAlgorithm", "AllreduceConfig"]


@dataclass(frozen=True, kw_only=True)
class AllreduceConfig:
    """Config of :class:`AllreduceAlgorithm`.

    Attributes:
        hierarchical: reduce inside each host first, so only host leaders cross the
            inter-host network (helps when several ranks share a host and links are slow).
        average: divide the sum by the world size (the usual data-parallel mean).
    """

    hierarchical: bool = False
    average: bool = True


class AllreduceAlgorithm(Algorithm):
    """Gradient allreduce per bucket; see :class:`AllreduceConfig`."""

    name = "allreduce"
    kind = "grad"
    passes_nonfinite = True  # a sum: Inf on one rank is Inf on all (GradScaler sees it)

    def __init__(self, config: AllreduceConfig | None = None) -> None:
        super().__init__(config or AllreduceConfig())
        self.config: AllreduceConfig
        self._groups: HostGroups | None = None

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        if self.config.hierarchical:
            self._groups = HostGroups.from_runtime(ctx.runtime)  # collective, at wrap time

    def bucket_ready(self, bucket: Bucket) -> Handle[torch.Tensor]:
        if self._groups is not None:
            return hierarchical_allreduce(self.ctx.comm, self._groups, bucket.flat,
                                          self.config.average)
        return primitives.allreduce(self.ctx.comm, bucket.flat, self.config.average)
