"""A wrapper's memory goes when the user lets go of it: no reference cycle keeps it.

With the cycle collector off (``gc.disable()``), what reference counting alone frees is
what a GPU job gets back at once: a wrapper kept alive by a cycle holds its buckets and
every algorithm state on the device until a collection happens to run. For each algorithm
(one rank, gloo): wrap, train 3 steps, then

- ``close()`` and ``del``: the wrapper, its buckets' buffers and the algorithm are freed,
  and the model's parameters are once the user drops the module and the optimizer too;
- ``close()`` alone: the buckets' buffers are freed while the wrapper object lives on
  (except where the algorithm keeps the buckets as its own state: DiLoCo's fragments,
  also local SGD's and SparseLoCo's; the algorithm object, which may be the user's,
  keeps its state until it is freed itself);
- ``del`` without ``close()`` (the drop-in case): the same as the first.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from hexagram.launch import run_local

ALGORITHMS = ("allreduce", "fp16", "powersgd", "topk", "qsgd", "dgc", "diloco", "sparseloco",
              "decoupled_momentum", "local_sgd", "async", "auto")
MODES = ("close_del", "del", "close")


def _train(name: str) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    from _every_algorithm import config_for, optimizer_for, small_model

    import hexagram as hx

    net = small_model()
    opt = optimizer_for(name, net.parameters())  # SGD with momentum (decoupled_momentum)
    ddp = hx.DistributedDataParallel(net, optimizers=[opt], bucket_size_mb=0.001,
                                     algorithm=hx.algorithms.get(name, **config_for(name)))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ddp, net, opt


def _lifetimes(name: str, mode: str) -> dict[str, bool]:
    """Which of wrapper / bucket buffer / algorithm / parameter are still alive, with the
    cycle collector off, after ``mode`` and after the user drops the module and optimizer."""
    ddp, net, opt = _train(name)
    refs = {"wrapper": weakref.ref(ddp), "flat": weakref.ref(ddp.buckets[0].flat),
            "algorithm": weakref.ref(ddp.algorithm),
            "parameter": weakref.ref(next(net.parameters()))}
    if mode != "del":
        ddp.close()
    out = {"flat after close": refs["flat"]() is not None} if mode == "close" else {}
    if mode != "close":
        del ddp
        out.update({f"{k} after del": r() is not None for k, r in refs.items()
                    if k != "parameter"})
    del net, opt
    if mode != "close":  # a wrapper the user still holds keeps its module, as it should
        out["parameter after dropping the model"] = refs["parameter"]() is not None
    return out


def _worker(names: tuple[str, ...]) -> dict[str, dict[str, bool]]:
    import hexagram as hx

    hx.init()
    gc.collect()
    gc.disable()  # reference counting alone from here on
    try:
        return {f"{name}/{mode}": _lifetimes(name, mode) for name in names for mode in MODES}
    finally:
        gc.enable()
        hx.shutdown()


@pytest.fixture(scope="module")
def lifetimes() -> dict[str, dict[str, bool]]:
    (out,) = run_local(_worker, 1, args=(ALGORITHMS,), timeout=600)
    return out



def _cases() -> list[Any]:
    return [(name, mode) for name in ALGORITHMS for mode in MODES]


@pytest.mark.parametrize(("name", "mode"), _cases())
def test_nothing_outlives_the_user_s_references(lifetimes: dict[str, dict[str, bool]],
                                                name: str, mode: str) -> None:
    alive = {what: still for what, still in lifetimes[f"{name}/{mode}"].items() if still}
    assert not alive, f"{name} ({mode}): still alive without the cycle collector: " \
        f"{sorted(alive)}"
