"""Algorithms made from candidate labels (``"NAME[:FIELD=VALUE...]"``, parsed by
:mod:`hexagram.cost.labels`).

Example:
    >>> parse_label("fp16:wire=bf16")
    ('fp16', {'wire': 'bf16'})
    >>> make("powersgd:rank=2").config.rank
    2
    >>> simulable("auto")
    'auto delegates to the algorithm it measures best; simulate the candidates'
"""

from __future__ import annotations

from hexagram.algorithms import registry
from hexagram.algorithms.base import Algorithm
from hexagram.config import unknown_name
from hexagram.cost.labels import applicable, parse_label

__all__ = ["applicable", "make", "parse_label", "simulable"]


def make(label: str) -> Algorithm:
    """A fresh algorithm instance for a candidate label."""
    name, config = parse_label(label)
    return registry.get(name, **config)


def simulable(label: str) -> Algorithm | str:
    """The algorithm ``label`` names, or why it cannot be simulated (``auto`` picks among
    others at run time): the ``make`` of :func:`hexagram.cost.simulate.simulate`.

    Raises:
        ConfigError: an unknown algorithm name (lists the registered ones).
    """
    name = parse_label(label)[0]
    if name == "auto":
        return "auto delegates to the algorithm it measures best; simulate the candidates"
    if name not in registry.names():
        raise unknown_name("algorithm", name, registry.names())
    return make(label)
