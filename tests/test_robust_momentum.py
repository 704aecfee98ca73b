"""Worker momentum of the ``robust`` algorithm (single process, hand-computed): the
optimizer's SGD momentum and weight decay taken over and given back, the heavy-ball buffer
SGD would keep, the explicit EMA form, checkpoint state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hexagram.buckets import Bucket
from hexagram.robust.momentum import WorkerMomentum


def _setup() -> tuple[nn.Parameter, nn.Parameter, torch.optim.SGD, Bucket]:
    a = nn.Parameter(torch.tensor([1.0, 2.0]))
    b = nn.Parameter(torch.tensor([4.0]))
    opt = torch.optim.SGD([{"params": [a], "momentum": 0.5, "weight_decay": 0.1},
                           {"params": [b], "momentum": 0.0}], lr=0.1)
    return a, b, opt, Bucket(0, [("a", a), ("b", b)])


def test_taken_over_momentum_is_sgds_buffer_and_is_given_back() -> None:
    a, b, opt, bucket = _setup()
    wm = WorkerMomentum(None)
    with pytest.warns(UserWarning, match="took over the optimizer's SGD momentum 0.5"):
        wm.take_over([opt], [("a", a), ("b", b)])
    assert opt.param_groups[0]["momentum"] == 0.0 and opt.param_groups[0]["weight_decay"] == 0.0
    assert wm.factors == {"a": (0.5, 0.1)}  # b's group has no momentum: b is sent as is
    bucket.flat.copy_(torch.tensor([1.0, -1.0, 3.0]))
    # step 1: m = g + wd w = (1 + 0.1, -1 + 0.2); b: its gradient
    assert torch.allclose(wm.apply(bucket), torch.tensor([1.1, -0.8, 3.0]))
    bucket.flat.copy_(torch.tensor([2.0, 0.0, -5.0]))
    # step 2: m = 0.5 m + g + wd w = (0.55 + 2 + 0.1, -0.4 + 0 + 0.2)
    sent = wm.apply(bucket)
    assert torch.allclose(sent, torch.tensor([2.65, -0.2, -5.0]))
    assert torch.equal(bucket.flat, torch.tensor([2.0, 0.0, -5.0]))  # gradient untouched
    # weight prediction steps by the momentum where it was taken over, else the gradient
    assert torch.allclose(wm.velocity("a"), torch.tensor([2.65, -0.2]))
    assert wm.velocity("b") is None
    state = wm.state_dict()
    wm.restore()
    assert opt.param_groups[0]["momentum"] == 0.5 and opt.param_groups[0]["weight_decay"] == 0.1
    again = WorkerMomentum(None)
    again.load_state_dict(state)
    bucket.flat.zero_()
    # step 3 from the checkpoint: m = 0.5 m + wd w
    assert torch.allclose(again.apply(bucket), torch.tensor([1.425, 0.1, 0.0]))


def test_taken_over_equals_sgd_momentum_on_the_mean() -> None:
    """The mean of the workers' momenta stepped by momentum-free SGD is SGD with momentum."""
    torch.manual_seed(0)
    ref, mine = nn.Linear(3, 2), nn.Linear(3, 2)
    mine.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    opt = torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    wm = WorkerMomentum(None)
    with pytest.warns(UserWarning):
        wm.take_over([opt], list(mine.named_parameters()))
    bucket = Bucket(0, list(mine.named_parameters()))
    for _ in range(4):
        x = torch.randn(5, 3)
        for net in (ref, mine):
            net.zero_grad()
            net(x).square().sum().backward()
        for e in bucket.entries:
            bucket.flat[e.offset:e.offset + e.numel].copy_(e.param.grad.reshape(-1))
        sent = wm.apply(bucket)
        for e in bucket.entries:
            e.param.grad.copy_(sent[e.offset:e.offset + e.numel].view(e.shape))
        opt_ref.step()
        opt.step()
    for p, q in zip(ref.parameters(), mine.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_explicit_momentum_is_an_ema_and_leaves_the_optimizer() -> None:
    a, b, opt, bucket = _setup()
    wm = WorkerMomentum(0.9)
    wm.take_over([opt], [("a", a), ("b", b)])
    assert opt.param_groups[0]["momentum"] == 0.5  # explicit: the optimizer keeps its own
    bucket.flat.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(wm.apply(bucket), torch.tensor([1.0, 2.0, 3.0]))
    bucket.flat.zero_()
    assert torch.allclose(wm.apply(bucket), torch.tensor([0.9, 1.8, 2.7]))  # 0.9 m + 0.1 g
    assert WorkerMomentum(0.0).apply(bucket) is bucket.flat  # no momentum: no copy


def test_gain_is_the_heavy_ball_length_so_centered_clipping_keeps_gradient_units() -> None:
    a, b, opt, bucket = _setup()
    wm = WorkerMomentum(None)
    with pytest.warns(UserWarning):
        wm.take_over([opt], [("a", a), ("b", b)])
    assert wm.gain() == pytest.approx(2.0)  # 1 / (1 - 0.5): the sum settles at 2 gradients
    bucket.flat.copy_(torch.tensor([1.0, 1.0, 1.0]))
    for _ in range(60):  # a constant gradient (no weight decay effect on the ratio's limit)
        sent = wm.apply(bucket)
    assert sent[0] / (1.0 + 0.1 * 1.0) == pytest.approx(2.0, rel=1e-6)
    wm.restore()
    assert WorkerMomentum(0.9).gain() == 1.0  # the EMA form stays at gradient length
    plain = torch.optim.SGD([a], lr=0.1)
    none = WorkerMomentum(None)
    none.take_over([plain], [("a", a)])  # no momentum to take: nothing sent longer
    assert none.gain() == 1.0
