"""Layer-wise compression costs a handful of ops per bucket, not per tensor.

Every dispatched aten op (``TorchDispatchMode``: views, copies, kernels) is counted over two
steady steps of a 128-tensor model at world 1 with one bucket: the model alone, torch DDP,
and each algorithm. An algorithm that looped over tensors would add ~10-60 ops per tensor
(1,300-7,700 here); compressing the bucket in one call keeps it within torch DDP's count plus
a few hundred. World 1 still runs every encode and decode (the collectives return at once).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hexagram.launch import run_local

#: algorithm -> config; layer granularity everywhere (the per-tensor case)
CASES: dict[str, dict[str, Any]] = {
    "fp16": {"granularity": "layer"},
    "bf16": {"granularity": "layer", "wire": "bf16"},
    "topk": {},
    "randomk": {},
    "powersgd": {"start_iter": 0},
}
MARGIN = 400
STEPS, COUNTED = 5, 2


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _model() -> nn.Module:
    """64 linear layers, 128 tensors: 64 matrices (32 x 32) and 64 biases."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(64)])


def _ops(kind: str, config: dict[str, Any]) -> int:
    import hexagram as hx

    net = _model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    if kind == "plain":
        model: nn.Module = net
    elif kind == "torch":
        model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=100)
    else:
        algo = hx.algorithms.get(kind.replace("bf16", "fp16"), **config)
        model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo,
                                           bucket_size_mb=100, first_bucket_mb=100)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    counter = _Count()
    for step in range(STEPS):
        counting = step >= STEPS - COUNTED
        if counting:
            counter.__enter__()
        try:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        finally:
            if counting:
                counter.__exit__(None, None, None)
    if kind not in ("plain", "torch"):
        assert len(model.buckets) == 1  # type: ignore[attr-defined]
        model.close()  # type: ignore[operator]
    return counter.ops


def _worker() -> dict[str, int]:
    import hexagram as hx

    hx.init()
    return {kind: _ops(kind, config)
            for kind, config in [("plain", {}), ("torch", {}), *CASES.items()]}


@pytest.fixture(scope="module")
def counts() -> dict[str, int]:
    return run_local(_worker, 1, timeout=600)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_ops_added_per_step_within_torch_ddp_plus_a_margin(counts: dict[str, int],
                                                           name: str) -> None:
    plain, ddp = counts["plain"], counts["torch"]
    added = counts[name] - plain
    assert added <= ddp - plain + MARGIN, (
        f"{name} adds {added} aten ops over {COUNTED} steps of a 128-tensor model; torch "
        f"DDP adds {ddp - plain}: something loops over the tensors")
