"""Communication algorithms, chosen by name: ``hexagram.algorithms.get("allreduce")``.

Wrappers compose with any gradient algorithm: ``get("powersgd", hierarchical=True)`` or
``wrap(get("fp16"), hierarchical=True)`` (see :mod:`hexagram.algorithms.wrappers`).
"""

from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.algorithms.registry import entries, get, names
from hexagram.algorithms.wrappers import wrap

__all__ = ["Algorithm", "AlgorithmContext", "entries", "get", "names", "wrap"]
