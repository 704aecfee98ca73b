"""``torch.compile`` with Hexagram's wrapper, in both orders, on 2 ranks (gloo, CPU).

``torch.compile(hx.DistributedDataParallel(net))`` compiles the module's forward whole: the
engine's pre-forward work (buffer broadcast, re-bucketing after the first backward, the
algorithm's ``before_forward``) runs eagerly and never reaches Dynamo, so
``torch._dynamo.explain`` counts 0 graph breaks, and none are counted over a training run.
``hx.DistributedDataParallel(torch.compile(net))`` works too. Either order trains exactly as
the eager wrapper: allreduce bit for bit, PowerSGD to float rounding.

The model has a BatchNorm layer (its buffers are broadcast before every forward, which used
to break the graph on every step). Backend ``aot_eager``: AOTAutograd's compiled forward and
backward (gradients arrive at the end of the compiled backward), no C++ compiler needed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hexagram.launch import run_local

STEPS = 4
BACKEND = "aot_eager"
ALGORITHMS = ("allreduce", "powersgd")
# outer: compile(wrap(net)); inner: wrap(compile(net)); inner_eager: the same wrapper run
# with torch.compiler.set_stance("force_eager") (its parameter names carry "_orig_mod.",
# which seed PowerSGD's initial Q: the eager reference for the inner order)
ORDERS = ("eager", "outer", "inner", "inner_eager")
REFERENCE = {"outer": "eager", "inner": "inner_eager"}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _wrapped(algorithm: str, order: str) -> tuple[Any, Any]:
    """(the wrapper, what the loop calls) for one order."""
    import hexagram as hx

    config = {"rank": 2, "start_iter": 0} if algorithm == "powersgd" else {}  # compress at once
    algo = hx.algorithms.get(algorithm, **config)
    net = _net()
    inner = torch.compile(net, backend=BACKEND) if order.startswith("inner") else net
    wrapper = hx.DistributedDataParallel(inner, algorithm=algo)
    return wrapper, torch.compile(wrapper, backend=BACKEND) if order == "outer" else wrapper


def _train(algorithm: str, order: str, rank: int) -> dict[str, Any]:
    import torch._dynamo as dynamo

    dynamo.reset()
    dynamo.utils.counters.clear()
    wrapper, model = _wrapped(algorithm, order)
    opt = torch.optim.SGD(wrapper.parameters(), lr=0.1, momentum=0.9)
    losses = []
    stance = "force_eager" if order == "inner_eager" else "default"
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        with torch.compiler.set_stance(stance):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = torch.cat([t.detach().flatten().float() for t in wrapper.state_dict().values()])
    params = torch.cat([p.detach().flatten() for p in wrapper.parameters()])
    out = {"losses": losses, "state": state, "params": params,
           "breaks": sum(dynamo.utils.counters["graph_break"].values())}
    wrapper.close()
    return out


def _explain(algorithm: str, order: str) -> tuple[int, int]:
    """(graphs, graph breaks) of the wrapped forward that re-buckets (the second)."""
    import torch._dynamo as dynamo

    wrapper, _ = _wrapped(algorithm, order)
    x = torch.randn(8, 16)
    wrapper(x).sum().backward()  # records the gradients' ready order
    report = dynamo.explain(wrapper)(x)
    wrapper.close()
    return report.graph_count, report.graph_break_count


def _worker() -> dict[str, Any]:
    import hexagram as hx

    rank = hx.init().rank
    out: dict[str, Any] = {}
    for algorithm in ALGORITHMS:
        for order in ORDERS:
            out[algorithm, order] = _train(algorithm, order, rank)
        for order in REFERENCE:
            out["explain", algorithm, order] = _explain(algorithm, order)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local(_worker, world_size=2, timeout=240)


@pytest.mark.parametrize("order", ["outer", "inner"])
def test_allreduce_compiled_equals_eager_bit_for_bit(results: list[dict[str, Any]],
                                                     order: str) -> None:
    for r in results:
        eager, compiled = r["allreduce", REFERENCE[order]], r["allreduce", order]
        assert compiled["losses"] == eager["losses"]
        assert torch.equal(compiled["state"], eager["state"])
    assert torch.equal(results[0]["allreduce", order]["params"],  # BatchNorm statistics
                       results[1]["allreduce", order]["params"])  # are per rank, as DDP


@pytest.mark.parametrize("order", ["outer", "inner"])
def test_powersgd_compiled_equals_eager(results: list[dict[str, Any]], order: str) -> None:
    for r in results:
        eager, compiled = r["powersgd", REFERENCE[order]], r["powersgd", order]
        torch.testing.assert_close(torch.tensor(compiled["losses"]),
                                   torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled["state"], eager["state"], rtol=1e-5, atol=1e-6)
        assert eager["losses"][-1] < eager["losses"][0]  # it trains


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("order", ["outer", "inner"])
def test_wrapped_forward_compiles_without_graph_breaks(results: list[dict[str, Any]],
                                                       algorithm: str, order: str) -> None:
    for r in results:
        assert r["explain", algorithm, order] == (1, 0)  # one graph: the whole module
        assert r[algorithm, order]["breaks"] == 0  # none over the training run either
