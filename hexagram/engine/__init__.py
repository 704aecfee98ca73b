"""The data-parallel engine: buckets, autograd hooks, overlap, consistency checks."""

from hexagram.engine.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
