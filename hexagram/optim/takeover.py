"""Take an optimizer's heavy-ball momentum over, and give it back.

Algorithms that must apply momentum *before* communication (DGC's and random-k's momentum
correction, robust aggregation of worker momenta) move the momentum and weight decay of
every plain momentum-SGD parameter group (no Nesterov, no dampening) into their own
buffers; those groups then read momentum 0 and weight decay 0 until :meth:`TakenMomentum.
restore`. Parameters of any other optimizer are left alone (factor absent).

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> opt = torch.optim.SGD([w], lr=0.1, momentum=0.9, weight_decay=1e-4)
    >>> taken = take_sgd_momentum([opt], [("w", w)])
    >>> taken.factors, opt.param_groups[0]["momentum"]
    ({'w': (0.9, 0.0001)}, 0.0)
    >>> taken.restore(); opt.param_groups[0]["momentum"]
    0.9
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TakenMomentum", "take_sgd_momentum"]


@dataclass
class TakenMomentum:
    """What :func:`take_sgd_momentum` took: per parameter name ``(momentum, weight
    decay)``, and the groups with their original values (for :meth:`restore`)."""

    factors: dict[str, tuple[float, float]] = field(default_factory=dict)
    groups: list[tuple[dict[str, Any], float, float]] = field(default_factory=list)

    def describe(self) -> str:
        """``"momentum 0.9 (weight decay 0.0001)"`` of the groups taken, for warnings."""
        m = "/".join(sorted({f"{mom:g}" for _, mom, _ in self.groups}))
        wd = "/".join(sorted({f"{w:g}" for _, _, w in self.groups}))
        return f"momentum {m} (weight decay {wd})"

    def restore(self) -> None:
        """Give every group taken its momentum and weight decay back (idempotent)."""
        for group, m, wd in self.groups:
            group["momentum"], group["weight_decay"] = m, wd
        self.groups = []


def take_sgd_momentum(optimizers: Sequence[torch.optim.Optimizer],
                      named_params: Sequence[tuple[str, torch.nn.Parameter]]) -> TakenMomentum:
    """Move the momentum and weight decay of plain momentum-SGD groups out of the optimizers
    (module doc); returns what was taken (empty when nothing qualifies)."""
    name_of = {id(p): n for n, p in named_params}
    taken = TakenMomentum()
    for opt in optimizers:
        for group in opt.param_groups:
            m = float(group.get("momentum", 0.0) or 0.0)
            if not (isinstance(opt, torch.optim.SGD) and m > 0 and not group.get("nesterov")
                    and not group.get("dampening")):
                continue
            wd = float(group.get("weight_decay", 0.0) or 0.0)
            for p in group["params"]:
                if id(p) in name_of:
                    taken.factors[name_of[id(p)]] = (m, wd)
            taken.groups.append((group, m, wd))
            group["momentum"], group["weight_decay"] = 0.0, 0.0
    return taken
