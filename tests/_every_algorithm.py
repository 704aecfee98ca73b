"""Shared helpers of the tests that run every registered algorithm (exit, device, GPU tiers).

Not a test module (leading underscore). ``CONFIGS`` shortens the periods of the delayed
algorithms so that a few steps include at least one communication round; every name of
``hexagram.algorithms.names()`` gets an entry automatically (a new algorithm is tested
without editing this file).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["CONFIGS", "config_for", "optimizer_for", "small_model", "train_steps"]

#: Config overrides so that a few steps communicate (defaults otherwise).
CONFIGS: dict[str, dict[str, Any]] = {
    "local_sgd": {"period": 2},
    "diloco": {"period": 2},
    "sparseloco": {"period": 2},
    "async": {"interval_ms": 5.0},
    "qadam": {},
    # 2 ranks admit no Byzantine rank (2f + 1 <= world size); the all-to-all of shards and
    # the allgather run all the same
    "robust": {"f": 0},
}


def config_for(name: str) -> dict[str, Any]:
    """Config of ``name`` for these short runs."""
    return dict(CONFIGS.get(name, {}))


def small_model(seed: int = 0) -> nn.Module:
    """An MLP whose layers differ in size (several buckets with ``bucket_size_mb`` small)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(),
                         nn.Linear(24, 4))


def optimizer_for(name: str, params: Any, lr: float = 0.05) -> torch.optim.Optimizer:
    """The optimizer ``name`` works with (QAdam needs its own; SGD otherwise)."""
    if name == "qadam":
        from hexagram.optim.qadam import QAdamOptimizer

        return QAdamOptimizer(params, lr=lr / 10, warmup_steps=2)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def train_steps(name: str, model: nn.Module, device: torch.device, steps: int = 4,
                dtype: torch.dtype = torch.float32, **wrap: Any) -> Any:
    """Wrap ``model`` with algorithm ``name`` and train ``steps`` steps on random data.

    Returns the wrapper (not closed: the caller decides).
    """
    import hexagram as hx

    rt = hx.get_runtime()
    opt = optimizer_for(name, model.parameters())
    algo = hx.algorithms.get(name, **config_for(name))
    ddp = hx.DistributedDataParallel(model, optimizers=[opt], algorithm=algo, **wrap)
    gen = torch.Generator().manual_seed(100 + rt.rank)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen).to(device=device, dtype=dtype)
        y = torch.randint(0, 4, (8,), generator=gen).to(device)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ddp
