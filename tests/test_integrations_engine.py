"""Engine support for frameworks: optimizers attached after wrapping, framework optimizer
wrappers, bad optimizers, the wrapped forward's signature, refusal of PyTorch DDP on top.

Runs in one spawned rank per test group (the wrapper needs a process group; the pytest
process stays uninitialised) plus a 2-rank local SGD run with a late-attached optimizer.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

from hexagram.launch import run_local


class Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
                ) -> torch.Tensor:
        return self.lin(input_ids)


def _single_rank() -> dict[str, Any]:
    import hexagram as hx
    from hexagram.errors import ConfigError

    hx.init()
    out: dict[str, Any] = {}
    net = Named()
    model = hx.DistributedDataParallel(net, algorithm="local_sgd", optimizers="later")
    out["signature"] = list(inspect.signature(model.forward).parameters)
    try:
        model(torch.randn(2, 4))
    except ConfigError as e:
        out["early_forward"] = str(e)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizers(opt, opt)  # duplicates are hooked once
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    out["steps_counted"] = model.algorithm.step
    out["hooks"] = len(model._step_hooks)
    try:
        torch.nn.parallel.DistributedDataParallel(model)
    except ConfigError as e:
        out["rewrap"] = str(e)
    for bad in (object(), [opt, "adam"]):
        try:
            hx.DistributedDataParallel(Named(), optimizers=bad)
        except ConfigError as e:
            out.setdefault("bad", []).append(str(e))
    model.close()
    return out


def _accelerated_optimizer() -> dict[str, Any]:
    from accelerate import Accelerator

    import hexagram as hx

    hx.init()
    accelerator = Accelerator(cpu=True)
    net = Named()
    opt = accelerator.prepare(torch.optim.SGD(net.parameters(), lr=0.1))
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm="local_sgd")
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # AcceleratedOptimizer.step -> torch optimizer step -> the engine's hook
    out = {"inner": model.optimizers[0] is opt.optimizer, "steps": model.algorithm.step}
    model.close()
    return out


def _late_local_sgd() -> list[float]:
    import hexagram as hx

    rt = hx.init()
    torch.manual_seed(rt.rank)  # different replicas: wrapping broadcasts rank 0's
    model = hx.DistributedDataParallel(Named(), optimizers="later",
                                       algorithm=hx.algorithms.get("local_sgd", period=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizers(opt)
    for step in range(4):
        torch.manual_seed(100 * rt.rank + step)
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    model.close()
    return weights


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return run_local(_single_rank, world_size=1, timeout=60)[0]


def test_wrapper_exposes_the_forward_signature(single: dict[str, Any]) -> None:
    assert single["signature"] == ["input_ids", "labels"]


def test_weight_algorithm_waits_for_an_optimizer(single: dict[str, Any]) -> None:
    assert "attach_optimizers" in single["early_forward"]
    assert single["steps_counted"] == 1 and single["hooks"] == 1


def test_pytorch_ddp_around_hexagram_is_refused(single: dict[str, Any]) -> None:
    assert "already wrapped by hexagram.DistributedDataParallel" in single["rewrap"]


def test_unknown_optimizer_objects_are_refused(single: dict[str, Any]) -> None:
    assert len(single["bad"]) == 2
    assert "builtins.object" in single["bad"][0] and "builtins.str" in single["bad"][1]
    assert all("neither a torch.optim.Optimizer nor a known framework wrapper" in m
               for m in single["bad"])


def test_accelerated_optimizer_is_unwrapped() -> None:
    pytest.importorskip("accelerate", reason="needs the 'integrations' extra (accelerate)")
    out = run_local(_accelerated_optimizer, world_size=1, timeout=90)[0]
    assert out == {"inner": True, "steps": 1}


def test_local_sgd_with_an_optimizer_attached_after_wrapping() -> None:
    a, b = run_local(_late_local_sgd, world_size=2, timeout=60)
    assert a == b
