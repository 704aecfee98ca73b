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

The engine marks its frames for Dynamo without importing ``torch._dynamo``
(``hexagram.engine.eager``): a process that wraps and trains never loads it, and a
``torch.compile`` applied later still skips the engine's work, also when it compiles a
function that calls the wrapper (one graph break there, as ``torch.compiler.disable`` gives).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from hexagram.launch import free_port, run_local

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


def _inlined() -> tuple[int, int, bool]:
    """(graphs, graph breaks, equal to eager) of a compiled function calling the wrapper."""
    import torch._dynamo as dynamo

    import hexagram as hx

    wrapper = hx.DistributedDataParallel(_net())
    x = torch.randn(8, 16)
    wrapper(x).sum().backward()

    def step(x: torch.Tensor) -> torch.Tensor:
        return wrapper(x).sum() * 2

    report = dynamo.explain(step)(x)
    with torch.no_grad():
        same = torch.equal(torch.compile(step, backend=BACKEND)(x), step(x))
    wrapper.close()
    return report.graph_count, report.graph_break_count, same


def _worker() -> dict[str, Any]:
    import hexagram as hx

    rank = hx.init().rank
    out: dict[str, Any] = {"inlined": _inlined()}
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


def test_a_compiled_caller_runs_the_wrapper_eagerly(results: list[dict[str, Any]]) -> None:
    for r in results:  # the caller's graph, the break at the wrapper, the module's graph
        assert r["inlined"] == (2, 1, True)


def test_wrapping_and_training_never_import_dynamo() -> None:
    """A fresh process (not a rank of the fork server, which preloads it)."""
    code = ("import sys, torch\nimport hexagram as hx\nhx.init()\n"
            "m = hx.DistributedDataParallel(torch.nn.Linear(4, 2), algorithm='powersgd')\n"
            "m(torch.randn(3, 4)).sum().backward()\nm.close()\n"
            "print('torch._dynamo' in sys.modules)")
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "False"
