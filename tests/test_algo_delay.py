"""``delay=1``: one-step delayed gradients around any gradient algorithm.

- against a hand-computed delayed-SGD sequence in float64 (plain loop, no hexagram):
  ``w[t+1] = w[t] - lr * mean_grad(w[t-1])``, zero gradient at step 0, the last gradient
  applied by ``synchronize()``; with ``gradient_as_bucket_view`` on and off, and composed
  with ``hierarchical=True`` (2 emulated hosts); all with ``predict=False``;
- ``delay_warmup``: synchronous steps first, then the pipeline, by hand;
- weight prediction (the default): heavy ball against a hand-computed sequence in which
  each rank computes its gradient at its own predicted weights and the true weights step
  on the stale mean;
- compressed algorithms (top-k with error feedback, seeded QSGD): gradients that do not
  depend on the weights make the delayed run deliver, at step t + 1, bit for bit what the
  synchronous run delivers at step t (the inner algorithm, its residuals and random
  streams, sees each gradient once, in order); wire bytes per step are the inner's;
- checkpoint resume is bit-exact; bad input raises errors naming the algorithm.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from torch import nn

import hexagram as hx
from hexagram.algorithms.delay import Delayed
from hexagram.errors import ConfigError
from hexagram.launch import run_local

WORLD = 2
STEPS = 5
LR = 0.1


# -- the hand-computed delayed-SGD sequence -------------------------------------------------
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


def expected_delayed_sgd(steps: int, warmup: int = 0) -> list[list[torch.Tensor]]:
    """Weights after each step, then after the flush: plain float64 loop, no hexagram.
    The first ``warmup`` steps are synchronous; the delay starts with a zero gradient."""
    net = _net()
    weights = [[p.detach().clone() for p in net.parameters()]]
    pending: list[torch.Tensor] | None = None  # mean gradient of the previous step
    for step in range(steps + 1):  # the extra round is synchronize()'s flush
        grads = None
        if step < steps:  # mean over ranks of the gradient at the current weights
            per_rank = [torch.autograd.grad(_loss(net, r, step), list(net.parameters()))
                        for r in range(WORLD)]
            grads = [sum(gs) / WORLD for gs in zip(*per_rank)]
        if step < warmup:  # synchronous: this step's own mean gradient
            pending = grads
            grads = None
        with torch.no_grad():
            for p, g in zip(net.parameters(), pending or [torch.zeros_like(p)
                                                          for p in net.parameters()]):
                p -= LR * g
        pending = grads  # type: ignore[assignment]
        weights.append([p.detach().clone() for p in net.parameters()])
    return weights[1:]


MOMENTUM = 0.9
WARMUP = 2


def expected_predicted_heavy_ball(steps: int, rank: int,
                                  local_velocity: bool = False) -> list[list[torch.Tensor]]:
    """``delay=1`` with weight prediction, by hand (float64, no hexagram): each rank runs
    forward and backward at ``P_r = u - lr * (b * buf + g_r)`` (its own gradient ``g_r``;
    ``buf`` the optimizer's momentum, or with ``local_velocity`` the rank's own velocity
    ``u_r = b u_r + g_r`` as DGC keeps it), the true weights ``u`` take heavy-ball steps
    on the previous step's mean gradient (zero at step 0). Returns rank ``rank``'s module
    weights after each step (``P_r``), then the true weights after the flush."""
    net = _net()
    u = [p.detach().clone() for p in net.parameters()]
    buf: list[torch.Tensor] | None = None
    velocity = [[torch.zeros_like(w) for w in u] for _ in range(WORLD)]
    predicted = [[w.clone() for w in u] for _ in range(WORLD)]
    pending = [torch.zeros_like(w) for w in u]
    seen = []
    for step in range(steps + 1):
        grads = []
        for r in range(WORLD):  # every rank's gradient at its own predicted weights
            with torch.no_grad():
                for p, w in zip(net.parameters(), predicted[r]):
                    p.copy_(w)
            grads.append(torch.autograd.grad(_loss(net, r, step), list(net.parameters())))
        buf = [g.clone() for g in pending] if buf is None else \
            [MOMENTUM * b + g for b, g in zip(buf, pending)]
        u = [w - LR * b for w, b in zip(u, buf)]  # the real step: heavy ball, stale mean
        if step == steps:  # synchronize(): the flush, then the true weights
            seen.append(u)
            break
        pending = [sum(gs) / WORLD for gs in zip(*grads)]
        velocity = [[MOMENTUM * v + g for v, g in zip(velocity[r], grads[r])]
                    for r in range(WORLD)]
        direction = velocity if local_velocity else \
            [[MOMENTUM * b + g for b, g in zip(buf, grads[r])] for r in range(WORLD)]
        predicted = [[w - LR * d for w, d in zip(u, direction[r])] for r in range(WORLD)]
        seen.append(predicted[rank])
    return seen


def _sequence_worker(rank: int) -> dict[str, list[list[torch.Tensor]]]:
    # (algorithm, gradient as bucket view, hierarchical, momentum, weight prediction)
    cases = {"view": ("allreduce", True, False, 0.0, False),
             "copy": ("allreduce", False, False, 0.0, False),
             "hierarchical": ("allreduce", True, True, 0.0, False),
             "predicted": ("allreduce", True, False, MOMENTUM, True),
             # DGC at density 1 takes the momentum over and is heavy ball: the prediction
             # must read DGC's velocity, the optimizer's momentum then reads 0
             "predicted_dgc": ("dgc", True, False, MOMENTUM, True),
             "warmup": ("allreduce", True, False, 0.0, False)}
    config = {"dgc": {"density": 1.0, "warmup_density": 1.0, "warmup_steps": 0}}
    out: dict[str, list[list[torch.Tensor]]] = {}
    for label, (name, as_view, hierarchical, momentum, predict) in cases.items():
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=momentum)
        algo = hx.algorithms.wrap(hx.algorithms.get(name, **config.get(name, {})),
                                  hierarchical=hierarchical, delay=1, predict=predict,
                                  delay_warmup=WARMUP if label == "warmup" else None)
        model = hx.DistributedDataParallel(net, [opt], algo, bucket_size_mb=0.0,
                                           gradient_as_bucket_view=as_view)
        seen = []
        for step in range(STEPS):
            _loss(model, rank, step).backward()
            opt.step()
            opt.zero_grad()
            seen.append([p.detach().clone() for p in net.parameters()])
        model.synchronize()
        seen.append([p.detach().clone() for p in net.parameters()])
        out[label] = seen
        model.close()  # nothing pending: must not step again
        assert all(torch.equal(a, b) for a, b in zip(seen[-1], net.parameters()))
    return out


def _fallback_worker(rank: int) -> list[tuple[list[torch.Tensor], dict[str, torch.Tensor]]]:
    """RMSprop (no exact prediction): per step, the module's weights and the true ones."""
    net = _net()
    opt = torch.optim.RMSprop(net.parameters(), lr=0.01)
    model = hx.DistributedDataParallel(net, [opt], hx.algorithms.get("allreduce", delay=1),
                                       bucket_size_mb=0.0)
    seen = []
    for step in range(4):
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
        true = model.algorithm_state_dict()["true_weights"]
        seen.append(([p.detach().clone() for p in net.parameters()], true))
    model.close()
    return seen


def _warmup_default_worker() -> dict[str, int]:
    """The default warm-up per optimizer (read once the optimizer is attached)."""
    out = {}
    for label, cls in (("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW),
                       ("adam", torch.optim.Adam)):
        net = _net()
        model = hx.DistributedDataParallel(net, [cls(net.parameters(), lr=0.01)],
                                           hx.algorithms.get("allreduce", delay=1))
        out[label] = model.algorithm.warmup_steps
        model.close()
    return out


def _worker() -> dict[str, Any]:
    """Every multi-rank case in one spawned job (one start-up for the module)."""
    os.environ["HEXAGRAM_HOST"] = os.environ["RANK"]  # 2 emulated hosts, 1 rank each
    rank = hx.init(timeout=60).rank
    out = {"sequences": _sequence_worker(rank), "compressed": _compressed_worker(rank),
           "resume": _resume_worker(rank), "every": _every_worker(rank),
           "join": _join_worker(rank), "fallback": _fallback_worker(rank),
           "warmup_default": _warmup_default_worker()}
    hx.shutdown()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local(_worker, WORLD, timeout=150)


@pytest.fixture(scope="module")
def sequences(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["sequences"] for r in results]


@pytest.mark.parametrize("label", ["view", "copy", "hierarchical"])
def test_matches_hand_computed_delayed_sgd(label: str,
                                           sequences: list[dict[str, Any]]) -> None:
    expected = expected_delayed_sgd(STEPS)
    first = [p.detach() for p in _net().parameters()]
    for rank, result in enumerate(sequences):
        got = result[label]
        assert len(got) == len(expected)
        # step 0 applies a zero gradient: the weights do not move
        assert all(torch.equal(a, b) for a, b in zip(got[0], first)), (label, rank)
        for step, (g, e) in enumerate(zip(got, expected)):
            for a, b in zip(g, e):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14,
                                           msg=f"{label}, rank {rank}, after step {step}")
    # the flush moved the weights: the last gradient was applied, not dropped
    assert not torch.equal(expected[-1][0], expected[-2][0])


def test_warmup_is_synchronous_then_delayed(sequences: list[dict[str, Any]]) -> None:
    """``delay_warmup=2``: steps 0 and 1 apply their own mean gradient, step 2 starts the
    pipeline (zero gradient), then one-step delay; the flush applies the last one."""
    expected = expected_delayed_sgd(STEPS, warmup=WARMUP)
    assert not torch.equal(expected[0][0], _net().state_dict()["0.weight"])  # step 0 moved
    assert torch.equal(expected[WARMUP][0], expected[WARMUP - 1][0])  # the zero step
    for rank, result in enumerate(sequences):
        for step, (g, e) in enumerate(zip(result["warmup"], expected)):
            for a, b in zip(g, e):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14,
                                           msg=f"warm-up, rank {rank}, after step {step}")


@pytest.mark.parametrize("label", ["predicted", "predicted_dgc"])
def test_weight_prediction_matches_hand_computed_heavy_ball(
        label: str, sequences: list[dict[str, Any]]) -> None:
    """Each rank's module holds its own predicted weights between steps; the flush leaves
    the true weights, equal on every rank, as the hand-computed sequence says."""
    for rank, result in enumerate(sequences):
        got = result[label]
        expected = expected_predicted_heavy_ball(STEPS, rank, label == "predicted_dgc")
        assert len(got) == len(expected)
        for step, (g, e) in enumerate(zip(got, expected)):
            for a, b in zip(g, e):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14,
                                           msg=f"{label}, rank {rank}, after step {step}")
    # predicted weights differ across ranks (own gradients), true weights do not
    assert not torch.equal(sequences[0][label][1][0], sequences[1][label][1][0])
    for a, b in zip(sequences[0][label][-1], sequences[1][label][-1]):
        assert torch.equal(a, b)


# -- compressed algorithms: the inner algorithm sees each gradient once ------------------------
class Probe(nn.Module):
    """loss = <w, c>: the gradient is ``c`` whatever the weights (fixed sequences)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(6, 40))
        self.b = nn.Parameter(torch.zeros(40))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c[:6]).sum() + (self.b * c[6]).sum()


def _grad(rank: int, step: int) -> torch.Tensor:
    return torch.randn(7, 40, generator=torch.Generator().manual_seed(100 * step + rank))


COMPRESSED = {"topk": {"density": 0.1}, "qsgd": {"levels": 3, "seed": 5}}


def _compressed_worker(rank: int) -> dict[str, Any]:
    from hexagram.cost.schedule import layout_of, wire_bytes

    out: dict[str, Any] = {}
    for name, config in COMPRESSED.items():
        for delay in (0, 1):
            net = Probe()
            opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
            model = hx.DistributedDataParallel(
                net, [opt], hx.algorithms.get(name, delay=delay, **config), bucket_size_mb=0.0)
            grads, sent, predicted = [], [], []
            for step in range(STEPS):
                before = model.bytes_sent()
                model(_grad(rank, step)).backward()
                sent.append(model.bytes_sent() - before)
                predicted.append(wire_bytes(model.algorithm, layout_of(model.buckets), WORLD))
                grads.append(torch.cat([net.w.grad.reshape(-1), net.b.grad]).clone())  # type: ignore[union-attr]
                opt.step()
                opt.zero_grad()
            if delay:
                applied = net.w.detach().clone()
                model.synchronize()  # applies the last pending gradient
                grads.append(-(net.w.detach() - applied).reshape(-1))
            out[f"{name}/{delay}"] = {"grads": grads, "sent": sent, "predicted": predicted,
                                      "total": model.bytes_sent(), "w": net.w.detach().clone()}
            model.close()
    return out


@pytest.fixture(scope="module")
def compressed(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["compressed"] for r in results]


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_compressed_delay_shifts_the_synchronous_sequence(
        name: str, compressed: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(compressed):
        sync, delayed = result[f"{name}/0"]["grads"], result[f"{name}/1"]["grads"]
        assert torch.count_nonzero(delayed[0]) == 0, "step 0 must apply a zero gradient"
        for step in range(STEPS - 1):  # delivered at t + 1 == synchronous at t, bit for bit
            assert torch.equal(delayed[step + 1], sync[step]), (name, rank, step)
        assert torch.count_nonzero(sync[0]) > 0
        # the flush: the last reduced gradient moved w by lr * (momentum-mixed) gradient
        assert torch.count_nonzero(delayed[-1]) > 0, (name, rank)


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_compressed_delay_sends_the_inner_bytes(name: str,
                                                compressed: list[dict[str, Any]]) -> None:
    for result in compressed:
        sync, delayed = result[f"{name}/0"], result[f"{name}/1"]
        # per step, a delayed scatter-gather's second leg may land in the next step's count
        # (it runs on the communicator's thread); once drained, the totals are equal
        assert delayed["total"] == sync["total"] == sum(sync["sent"])
        assert delayed["predicted"] == sync["sent"]  # the cost model sees through delay


def test_compressed_delay_replicas_agree(compressed: list[dict[str, Any]]) -> None:
    for key in compressed[0]:
        assert torch.equal(compressed[0][key]["w"], compressed[1][key]["w"]), key


# -- checkpoints -------------------------------------------------------------------------------
def _train(model: Any, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x, y = _batch(rank, step)
        (model(x.float()) - y.float()).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _wrapped() -> tuple[nn.Module, Any, torch.optim.Optimizer]:
    net = _net().float()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    algo = hx.algorithms.get("topk", delay=1, density=0.3)
    return net, hx.DistributedDataParallel(net, [opt], algo, bucket_size_mb=0.0), opt


def _resume_worker(rank: int) -> dict[str, list[torch.Tensor]]:
    net, model, opt = _wrapped()
    _train(model, opt, rank, range(6))
    model.synchronize()
    straight = [p.detach().clone() for p in net.parameters()]
    model.close()

    net, model, opt = _wrapped()
    _train(model, opt, rank, range(3))
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                          "algo": model.algorithm_state_dict()})
    assert ckpt["algo"]["pending"], "step 2's reduced gradient must be in the checkpoint"
    model.close()
    net, model, opt = _wrapped()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    model.load_algorithm_state_dict(ckpt["algo"])
    _train(model, opt, rank, range(3, 6))
    model.synchronize()
    resumed = [p.detach().clone() for p in net.parameters()]
    model.close()
    return {"straight": straight, "resumed": resumed}


def _join_worker(rank: int) -> list[torch.Tensor]:
    """Uneven inputs: rank 0 trains 4 steps, rank 1 two; synchronize() after join()."""
    net, model, opt = _wrapped()
    with model.join():
        _train(model, opt, rank, range(4 if rank == 0 else 2))
    model.synchronize()
    weights = [p.detach().clone() for p in net.parameters()]
    model.close()
    return weights


def test_join_then_synchronize_keeps_replicas_equal(results: list[dict[str, Any]]) -> None:
    first = [p.detach().float() for p in _net().parameters()]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["join"], results[1]["join"]))
    assert not torch.equal(results[0]["join"][0], first[0])


def test_checkpoint_resume_is_exact(results: list[dict[str, Any]]) -> None:
    for result in (r["resume"] for r in results):
        for a, b in zip(result["straight"], result["resumed"]):
            assert torch.equal(a, b)


# -- every gradient algorithm ----------------------------------------------------------------
def _gradient_algorithms() -> list[str]:
    from hexagram.algorithms import registry

    return [n for n in registry.names() if registry.get(n).kind == "grad"]


def _every_worker(rank: int) -> dict[str, list[torch.Tensor]]:
    """Each gradient algorithm with delay=1 (tests/_every_algorithm.py's model, optimizer
    and config): a few steps, then synchronize(); the weights of both ranks must agree."""
    from _every_algorithm import config_for, optimizer_for, small_model

    out = {}
    for name in _gradient_algorithms():
        net = small_model()
        opt = optimizer_for(name, net.parameters())
        algo = hx.algorithms.get(name, delay=1, **config_for(name))
        model = hx.DistributedDataParallel(net, [opt], algo, bucket_size_mb=0.001)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        model.synchronize()
        out[name] = [p.detach().clone() for p in net.parameters()]
        model.close()
    return out


@pytest.mark.parametrize("name", _gradient_algorithms())
def test_every_gradient_algorithm_trains_delayed(name: str,
                                                 results: list[dict[str, Any]]) -> None:
    first = [p.detach() for p in _every_small_model().parameters()]
    mine, peer = results[0]["every"][name], results[1]["every"][name]
    assert all(torch.equal(a, b) for a, b in zip(mine, peer)), f"{name}: replicas differ"
    assert not all(torch.equal(a, b) for a, b in zip(mine, first)), f"{name}: never stepped"


def _every_small_model() -> nn.Module:
    from _every_algorithm import small_model

    return small_model()


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["local_sgd", "diloco", "async", "decentralized"])
def test_delay_on_a_weight_algorithm_names_it(name: str) -> None:
    with pytest.raises(ConfigError, match=f"'{name}'.*without delay"):
        hx.algorithms.get(name, delay=1)
    assert not isinstance(hx.algorithms.get(name, delay=0), Delayed)


@pytest.mark.parametrize("delay", [2, -1, True, 0.5, "1"])
def test_delay_out_of_range_names_the_algorithm(delay: Any) -> None:
    with pytest.raises(ConfigError, match="algorithm 'qsgd': delay must be 0"):
        hx.algorithms.get("qsgd", delay=delay)


def test_delay_twice_and_auto_that_may_delay_are_refused() -> None:
    with pytest.raises(ConfigError, match="'topk' is delayed already"):
        hx.algorithms.wrap(hx.algorithms.get("topk", delay=1), delay=1)
    with pytest.raises(ConfigError, match="allow_delay"):
        hx.algorithms.get("auto", delay=1, allow_delay=True)


def test_every_gradient_algorithm_accepts_delay() -> None:
    from hexagram.algorithms import registry

    for name in registry.names():
        if registry.get(name).kind == "grad":
            algo = hx.algorithms.get(name, delay=1)
            assert isinstance(algo, Delayed) and algo.inner.name == name


def test_wire_model_sees_through_delay() -> None:
    from hexagram.cost.schedule import TensorSpec, wire_bytes

    layout = [[TensorSpec("w", (300, 100))], [TensorSpec("b", (100,))]]
    for name in ("allreduce", "topk", "qsgd", "powersgd", "gtopk"):
        assert wire_bytes(hx.algorithms.get(name, delay=1), layout, 4) == \
            wire_bytes(hx.algorithms.get(name), layout, 4), name


def test_other_optimizers_predict_by_repeating_the_last_update(
        results: list[dict[str, Any]]) -> None:
    """An optimizer without an exact formula (RMSprop): the module runs at
    ``true + (true - previous true)``; at the first step, with no previous, at the true."""
    for r in results:
        seen = r["fallback"]
        names = list(seen[0][1])
        assert len(names) == 4  # two weights, two biases
        for step, (module, true) in enumerate(seen):
            for name, weight in zip(names, module):
                expected = true[name] if step == 0 else \
                    true[name] + (true[name] - seen[step - 1][1][name])
                torch.testing.assert_close(weight, expected, rtol=0, atol=1e-15)
        assert not torch.equal(seen[3][0][0], seen[3][1][names[0]])  # it did move


def test_default_warmup_is_for_adam_only(results: list[dict[str, Any]]) -> None:
    from hexagram.algorithms.delay import ADAM_WARMUP

    for r in results:
        assert r["warmup_default"] == {"sgd": 0, "adamw": ADAM_WARMUP, "adam": ADAM_WARMUP}


def test_delay_warmup_is_checked() -> None:
    with pytest.raises(ConfigError, match="delay_warmup"):
        hx.algorithms.get("topk", delay=1, delay_warmup=-1)
    with pytest.raises(ConfigError, match="delay_warmup applies to delay=1 only"):
        hx.algorithms.get("topk", delay_warmup=5)
