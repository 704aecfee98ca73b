"""Datasets that ship offline."""

from hexagram.data.vision import Dataset, fashion_mnist_available, load, shard

__all__ = ["Dataset", "fashion_mnist_available", "load", "shard"]
