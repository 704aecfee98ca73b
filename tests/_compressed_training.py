"""Shared helpers of the compressed-algorithm tests: train a small MLP on digits per algorithm.

Not a test module (leading underscore): imported by tests/test_algo_compressed*.py and run
inside ranks spawned by hexagram.launch.run_local.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Spec", "train_specs"]


@dataclass(frozen=True)
class Spec:
    """One training run: algorithm name, its config, and the optimizer's settings."""

    algorithm: str
    config: dict[str, Any] = field(default_factory=dict)
    lr: float = 0.1
    momentum: float = 0.9
    label: str = ""

    @property
    def key(self) -> str:
        return self.label or self.algorithm


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean()) * 100.0


def _train_one(spec: Spec, epochs: int, batch: int) -> dict[str, Any]:
    import hexagram as hx
    from hexagram.data import load, shard
    from hexagram.models.mlp import mlp

    rt = hx.get_runtime()
    ds = load("digits")
    x, y = shard(ds.x_train, ds.y_train, rt.rank, rt.world_size)
    torch.manual_seed(0)
    net = mlp(in_features=64, hidden=64, layers=1, classes=10)
    opt = torch.optim.SGD(net.parameters(), lr=spec.lr, momentum=spec.momentum)
    algo = hx.algorithms.get(spec.algorithm, **spec.config)
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo, bucket_size_mb=25.0)
    steps = 0
    # lr x 0.1 for the last quarter: the final accuracy then reflects where training
    # converged, not the noise of the last few steps
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [epochs * 3 // 4], gamma=0.1)
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(y) - batch + 1, batch):
            idx = order[start:start + batch]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
            steps += 1
        sched.step()
    result = {"acc": _accuracy(net, ds.x_test, ds.y_test), "digest": _digest(net),
              "bytes_per_step": model.bytes_sent() / steps, "steps": steps}
    model.close()
    return result


def train_specs(specs: list[Spec], epochs: int, batch: int) -> dict[str, dict[str, Any]]:
    """Run every spec on this rank (call inside run_local); results keyed by spec.key."""
    import hexagram as hx

    hx.init()
    return {s.key: _train_one(s, epochs, batch) for s in specs}
