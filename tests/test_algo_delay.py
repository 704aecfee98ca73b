"""``delay=1``: one-step delayed gradients, the update rule against hand-computed sequences.

- against a hand-computed delayed-SGD sequence in float64 (plain loop, no hexagram):
  ``w[t+1] = w[t] - lr * mean_grad(w[t-1])``, zero gradient at step 0, the last gradient
  applied by ``synchronize()``; with ``gradient_as_bucket_view`` on and off, and composed
  with ``hierarchical=True`` (2 emulated hosts); all with ``predict=False``;
- ``delay_warmup``: synchronous steps first, then the pipeline, by hand;
- weight prediction (the default): heavy ball against a hand-computed sequence in which
  each rank computes its gradient at its own predicted weights and the true weights step
  on the stale mean; other optimizers repeat the last update; Adam's default warm-up.

Compressed and every other gradient algorithm under delay, checkpoints, join and bad
input: ``tests/test_algo_delay_inner.py``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _delay_common import LR, STEPS, WORLD, _loss, _net

import hexagram as hx
from hexagram.launch import run_local


# -- the hand-computed delayed-SGD sequence -------------------------------------------------
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
        model = hx.DistributedDataParallel(net, optimizers=[opt],
                                           algorithm=algo, bucket_size_mb=0.0,
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
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get("allreduce", delay=1),
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
        model = hx.DistributedDataParallel(net, optimizers=[cls(net.parameters(), lr=0.01)],
                                           algorithm=hx.algorithms.get("allreduce", delay=1))
        out[label] = model.algorithm.warmup_steps
        model.close()
    return out


def _worker() -> dict[str, Any]:
    """Every multi-rank case of this module in one spawned job (one start-up)."""
    os.environ["HEXAGRAM_HOST"] = os.environ["RANK"]  # 2 emulated hosts, 1 rank each
    rank = hx.init(timeout=60).rank
    out = {"sequences": _sequence_worker(rank), "fallback": _fallback_worker(rank),
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
