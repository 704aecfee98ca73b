"""Shared helpers of the ``delay=1`` tests (``test_algo_delay.py``, ``test_algo_delay_inner.py``):
the float64 net, the seeded per-rank batches and their loss.

Not a test module (leading underscore).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LR", "STEPS", "WORLD", "_batch", "_loss", "_net"]

WORLD = 2
STEPS = 5
LR = 0.1


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1)).double()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(8, 4, generator=g, dtype=torch.float64),
            torch.randn(8, 1, generator=g, dtype=torch.float64))


def _loss(net: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return (net(x) - y).square().mean()
