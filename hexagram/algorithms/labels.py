"""Candidate labels: ``"NAME[:FIELD=VALUE...]"`` names an algorithm with its config.

``auto``'s candidates, ``hexagram advise`` and ``hexagram simulate`` name algorithms this
way; the values are JSON (``true``, ``4``, ``"bf16"``) or bare strings.

Example:
    >>> parse_label("fp16:wire=bf16")
    ('fp16', {'wire': 'bf16'})
    >>> make("powersgd:rank=2").config.rank
    2
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from hexagram.algorithms import registry
from hexagram.algorithms.base import Algorithm
from hexagram.errors import ConfigError

if TYPE_CHECKING:
    from hexagram.cost.probe import NetworkProfile

__all__ = ["applicable", "make", "parse_label"]


def parse_label(label: str) -> tuple[str, dict[str, Any]]:
    """``"allreduce:hierarchical=true"`` -> ``("allreduce", {"hierarchical": True})``."""
    name, *pairs = label.split(":")
    config: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"candidate {label!r}: expected NAME[:FIELD=VALUE...], e.g. "
                              "'fp16:wire=bf16'")
        try:
            config[key] = json.loads(value)
        except json.JSONDecodeError:
            config[key] = value
    return name.strip(), config


def make(label: str) -> Algorithm:
    """A fresh algorithm instance for a candidate label."""
    name, config = parse_label(label)
    return registry.get(name, **config)


def applicable(label: str, network: NetworkProfile) -> bool:
    """Hierarchical allreduce only differs from the flat one with several ranks on each
    of several hosts."""
    hier = parse_label(label)[1].get("hierarchical", False)
    return not hier or 1 < network.hosts < network.world
