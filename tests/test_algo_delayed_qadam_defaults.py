"""QAdam with Adam's defaults (eps=1e-8) under the benchmark harness's settings.

Regression: ``hexagram bench --algorithms qadam --warmup 10`` (the harness's ReLU MLP, its
``make_optimizer``: lr 1e-3, 10 warm-up steps) raised ``NonFiniteGradientError`` on the first
compressed step. Elements of ReLU units that were dead on every warm-up batch froze with
``v_hat = 0``, i.e. a denominator of ``eps``; once such a unit came back to life its step
was ``lr * m / 1e-8`` and the weights overflowed within three steps. The optimizer now
floors the frozen variance (``QAdamOptimizer.variance_floor``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hexagram.launch import run_local

WARMUP, STEPS, BATCH = 10, 60, 32


def _digits_28() -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the handwritten digits (real scans, always offline), upsampled
    from 8x8 to the 28x28 input of the harness's MLP."""
    from hexagram.data import load, shard

    ds = load("digits")
    x, y = shard(ds.x_train, ds.y_train, dist.get_rank(), dist.get_world_size())
    x = nn.functional.interpolate(x.reshape(-1, 1, 8, 8), size=(28, 28), mode="bilinear")
    return x.reshape(len(y), 784), y


def _worker() -> dict[str, object]:
    import hexagram as hx
    from hexagram.bench.peers import make_optimizer
    from hexagram.models.workload import ModelSpec, build_workload

    hx.init()
    work = build_workload(ModelSpec(name="mlp", params=300_000), seed=0)
    opt = make_optimizer("qadam", work.model.parameters(), 0.01, warmup=WARMUP)
    assert opt.defaults["eps"] == 1e-8  # Adam's default, as the harness uses it
    model = hx.DistributedDataParallel(work.model, optimizers=[opt],
                                       algorithm=hx.algorithms.get("qadam"))
    xs, ys = _digits_28()
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        idx = torch.randint(0, len(ys), (BATCH,), generator=gen)
        x, y = xs[idx], ys[idx]
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = torch.cat([p.detach().reshape(-1) for p in work.model.parameters()])
    model.close()
    return {"losses": losses, "finite": bool(torch.isfinite(weights).all()),
            "max_abs": float(weights.abs().max())}


def test_qadam_default_eps_harness_settings_train_stably() -> None:
    for rank, r in enumerate(run_local(_worker, 4, timeout=120)):
        losses = r["losses"]
        assert r["finite"] and r["max_abs"] < 10.0, (rank, r["max_abs"])
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        assert last < first - 0.1, (rank, first, last)


def test_frozen_variance_floor_bounds_the_step_of_a_revived_element() -> None:
    """One element gets no gradient during the warm-up, then a typical one: its step is
    about lr / sqrt(variance_floor), not lr * m / eps."""
    from hexagram.optim import QAdamOptimizer

    p = nn.Parameter(torch.zeros(4))
    opt = QAdamOptimizer([p], lr=1e-3, warmup_steps=3)  # eps = 1e-8, floor = 0.01
    for _ in range(3):
        p.grad = torch.tensor([1.0, -1.0, 1.0, 0.0])  # element 3: dead during the warm-up
        opt.step()
    v_hat = opt.state[p]["v_hat"]
    # the mean before clamping is 3/4 of the live elements' variance
    assert v_hat[3].item() == pytest.approx(0.01 * 0.75 * v_hat[0].item(), rel=1e-6)
    before = p.detach().clone()
    p.grad = torch.ones(4)
    opt.step()
    step = (p.detach() - before).abs()
    assert step[3].item() < 20 * 1e-3, step  # was 1e-3 * 0.1 / 1e-8 = 1e4 before the floor
    assert torch.equal(opt.state[p]["v_hat"], v_hat)  # still frozen


def test_variance_floor_is_validated() -> None:
    from hexagram.errors import ConfigError
    from hexagram.optim import QAdamOptimizer

    with pytest.raises(ConfigError, match="variance_floor"):
        QAdamOptimizer([nn.Parameter(torch.ones(1))], variance_floor=2.0)


def test_frozen_denominator_is_kept_until_the_variance_or_eps_changes() -> None:
    """The frozen denominator is computed once; a changed v_hat (in place or loaded) or eps
    gives the new value, never a stale one."""
    from hexagram.optim import QAdamOptimizer

    p = nn.Parameter(torch.zeros(3))
    opt = QAdamOptimizer([p], lr=1e-3, warmup_steps=2, variance_floor=0.0)
    for g in ([1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [1.0, 1.0, 1.0]):
        p.grad = torch.tensor(g)
        opt.step()
    d = opt.denominator(p)
    assert opt.denominator(p) is d  # frozen: not recomputed
    assert torch.equal(d, opt.state[p]["v_hat"].sqrt() + 1e-8)
    opt.state[p]["v_hat"].mul_(4.0)  # in place: the version changes
    assert torch.allclose(opt.denominator(p), 2 * d, rtol=1e-6)
    opt.param_groups[0]["eps"] = 1.0
    assert torch.equal(opt.denominator(p), opt.state[p]["v_hat"].sqrt() + 1.0)
    state = opt.state_dict()
    state["state"][0]["v_hat"] = torch.full((3,), 9.0)
    opt.load_state_dict(state)
    assert torch.equal(opt.denominator(p), torch.full((3,), 4.0))  # sqrt(9) + eps 1
