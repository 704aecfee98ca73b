"""Datasets that ship offline."""

from hexagram.data.text import TextCorpus, load_text
from hexagram.data.vision import Dataset, fashion_mnist_available, load, shard

__all__ = ["Dataset", "TextCorpus", "fashion_mnist_available", "load", "load_text", "shard"]
