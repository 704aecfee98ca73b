"""Weight prediction (``delay=1``'s default): the predicted update equals the optimizer's.

For every optimizer the prediction knows exactly (SGD in all its variants, Adam, AdamW,
AMSGrad, coupled and decoupled weight decay, ``maximize``), the update it predicts for a
gradient equals, to rounding, what the optimizer's own ``step()`` then does with that
gradient; nothing in the optimizer moves while predicting. Other optimizers get the last
update repeated.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from hexagram.algorithms.predict import predicted_update

CASES: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.5, "dampening": 0.3, "maximize": True}),
    (torch.optim.Adam, {"lr": 1e-2}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.8, 0.99), "maximize": True}),
]


def _grad(seed: int) -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


@pytest.mark.parametrize("steps_before", [0, 1, 3])
@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=lambda c: str(c))
def test_prediction_equals_the_optimizers_next_update(
        cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], steps_before: int) -> None:
    param = torch.nn.Parameter(_grad(99))
    opt = cls([param], **kwargs)
    for s in range(steps_before):  # build up momentum / moments
        param.grad = _grad(s)
        opt.step()
    state_before = copy.deepcopy(opt.state_dict())
    grad = _grad(42)
    if steps_before == 0 and cls is not torch.optim.SGD:
        # Adam has no moments before its first step: nothing to predict from
        assert predicted_update(opt, opt.param_groups[0], param, grad, None) is None
        return
    with torch.no_grad():
        update = predicted_update(opt, opt.param_groups[0], param, grad, None)
    assert update is not None
    assert str(opt.state_dict()) == str(state_before), "predicting must not move the state"
    in_place = predicted_update(opt, opt.param_groups[0], param, grad.clone(), None,
                                scratch=True)
    assert in_place is not None
    torch.testing.assert_close(in_place, update, rtol=1e-12, atol=1e-15)
    true = param.detach().clone()
    param.grad = grad
    opt.step()
    torch.testing.assert_close(param.detach() - true, update, rtol=1e-10, atol=1e-14)


def test_other_optimizers_repeat_the_last_update() -> None:
    param = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = torch.optim.RMSprop([param], lr=0.1)
    previous = param.detach().clone()
    param.grad = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    opt.step()
    update = predicted_update(opt, opt.param_groups[0], param, param.grad, previous)
    assert update is not None
    assert torch.equal(update, param.detach() - previous)
    assert predicted_update(opt, opt.param_groups[0], param, param.grad, None) is None


@pytest.mark.parametrize("steps_before", [1, 2, 5])  # warm-up 3: Adam, the freeze, frozen
def test_qadam_predicts_its_own_next_update(steps_before: int) -> None:
    from hexagram.optim import QAdamOptimizer

    param = torch.nn.Parameter(_grad(99))
    opt = QAdamOptimizer([param], lr=1e-2, weight_decay=0.01, warmup_steps=3)
    for s in range(steps_before):
        param.grad = _grad(s)
        opt.step()
    grad = _grad(42)
    with torch.no_grad():
        update = predicted_update(opt, opt.param_groups[0], param, grad, None)
    assert update is not None
    true = param.detach().clone()
    param.grad = grad
    opt.step()
    torch.testing.assert_close(param.detach() - true, update, rtol=1e-10, atol=1e-14)
