"""Multi-layer perceptrons of configurable size.

Example:
    >>> m = mlp(in_features=784, hidden=256, layers=2, classes=10)
    >>> sum(p.numel() for p in m.parameters())
    269322
    >>> hidden_for_params(6_300_000, in_features=784, layers=3, classes=10) > 1000
    True
"""

from __future__ import annotations

import math

from torch import nn

__all__ = ["hidden_for_params", "mlp"]


def mlp(in_features: int, hidden: int, layers: int, classes: int) -> nn.Sequential:
    """Flatten -> ``layers`` x (Linear(hidden) + ReLU) -> Linear(classes)."""
    if layers < 1 or hidden < 1:
        raise ValueError(f"layers and hidden must be >= 1, got layers={layers}, hidden={hidden}")
    mods: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    mods.append(nn.Linear(width, classes))
    return nn.Sequential(*mods)


def hidden_for_params(params: int, in_features: int, layers: int, classes: int) -> int:
    """Hidden width giving about ``params`` parameters for :func:`mlp`."""
    # params ~= (layers-1) h^2 + (in + classes + layers) h
    a, b = layers - 1, in_features + classes + layers
    if a == 0:
        return max(1, params // b)
    return max(1, int((-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)))
