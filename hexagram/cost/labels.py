"""Candidate labels: ``"NAME[:FIELD=VALUE...]"`` names an algorithm with its config.

``auto``'s candidates, ``hexagram advise`` and ``hexagram simulate`` name algorithms this
way; the values are JSON (``true``, ``4``, ``"bf16"``) or bare strings. Parsing a label
needs no algorithm; making one from it is the registry's
(:func:`hexagram.algorithms.labels.make`).

Example:
    >>> parse_label("fp16:wire=bf16")
    ('fp16', {'wire': 'bf16'})
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from hexagram.errors import ConfigError

if TYPE_CHECKING:
    from hexagram.cost.probe import NetworkProfile

__all__ = ["applicable", "parse_label"]


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


def applicable(label: str, network: NetworkProfile) -> bool:
    """Hierarchical allreduce only differs from the flat one with several ranks on each
    of several hosts."""
    hier = parse_label(label)[1].get("hierarchical", False)
    return not hier or 1 < network.hosts < network.world
