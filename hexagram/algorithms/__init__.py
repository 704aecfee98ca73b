"""Communication algorithms, chosen by name: ``hexagram.algorithms.get("allreduce")``."""

from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.algorithms.registry import entries, get, names

__all__ = ["Algorithm", "AlgorithmContext", "entries", "get", "names"]
