"""Weight prediction for ``delay=1``: compute each gradient where it will be applied.

With one-step delay the gradient computed at step ``t`` reaches the optimizer at step
``t + 1``, where it is applied to weights that have moved on by one update. With momentum
that move is large, and the stale gradient shrinks the stable step size: heavy ball at
``b = 0.9`` is stable on a quadratic of curvature ``h`` only while ``lr h < 1 - b = 0.1``
instead of ``< 2 (1 + b) = 3.8`` (docs/benchmarks/delay.md). Weight prediction (as in
pipelined training: PipeMare, SpecTrain) removes the mismatch instead of shrinking the step:
after the optimizer's real step the module's parameters are moved to

    predicted = true + update(true, optimizer state, local gradient of this step)

i.e. the weights the *next* real step will produce, with the rank's own gradient of this
step standing in for the mean that is still on the wire. The next forward and backward run
there, so the gradient that step ``t + 2`` applies was computed at (a close prediction of)
the weights it is applied to. Before every real step the true weights are put back, bit for
bit, from a copy (never by subtracting the prediction: floating point would let replicas
drift). On a quadratic the prediction is exact and the method is as stable as synchronous
heavy ball; in practice the error is ``lr * (local - mean gradient)``, a per-rank noise
of one step. Replicas keep identical true weights, because only reduced gradients update
them.

The update is computed from the optimizer's own state and hyper-parameters at the time of
the prediction, without calling ``step()`` (no hooks fire, no counters move):

- ``torch.optim.SGD``: momentum, dampening, Nesterov, weight decay, ``maximize``;
- ``torch.optim.Adam`` / ``AdamW``: bias-corrected moments, ``amsgrad``, coupled or
  decoupled weight decay, ``maximize``;
- an optimizer with a method ``predicted_update(param, grad) -> Tensor | None`` (the
  update its next step would make, changing nothing): that method
  (:class:`hexagram.optim.QAdamOptimizer` has one);
- any other optimizer: the last update repeated (``true - previous true``), which is the
  linear extrapolation of SpecTrain; it restores much of the stability (on the quadratic
  above ``lr h < 0.27``), not all.

Cost: two parameter-sized buffers (the true weights and this step's local gradient) and
about six element-wise passes per step (SGD's update computed in place). The learning
rate is the one the optimizer holds when the prediction is made (a scheduler that changes
it afterwards makes the prediction off by that change, not wrong in direction).

Example:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.tensor([1.0]))
    >>> opt = torch.optim.SGD([p], lr=0.1)
    >>> predicted_update(opt, opt.param_groups[0], p, torch.tensor([2.0]), None)
    tensor([-0.2000])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["predicted_update"]


def predicted_update(optimizer: torch.optim.Optimizer, group: dict[str, Any], param: Tensor,
                     grad: Tensor, previous: Tensor | None,
                     scratch: bool = False) -> Tensor | None:
    """The update ``optimizer``'s next step would add to ``param`` given ``grad``.

    ``param`` holds the true weights, ``previous`` the true weights before the step just
    taken (used by optimizers without an exact formula; None: no prediction for them).
    With ``scratch`` the SGD update is computed in ``grad`` itself (no parameter-sized
    temporaries: ``delay=1`` passes its own copy of the gradient). Returns None when
    nothing can be predicted (the step is then taken at the true weights).
    """
    own = getattr(optimizer, "predicted_update", None)
    if callable(own):  # the optimizer knows its own next step (e.g. QAdamOptimizer)
        return own(param, grad)  # type: ignore[no-any-return]
    state = optimizer.state.get(param, {})
    if isinstance(optimizer, torch.optim.SGD):
        return _sgd(group, state, param, grad if scratch else grad.clone())
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and "exp_avg" in state:
        return _adam(optimizer, group, state, param, grad)
    return None if previous is None else param.detach() - previous


def _sgd(group: dict[str, Any], state: dict[str, Any], param: Tensor, grad: Tensor) -> Tensor:
    """SGD's next update, written into ``grad`` (no further parameter-sized tensors)."""
    if group.get("maximize", False):
        grad.neg_()
    if group["weight_decay"]:
        grad.add_(param.detach(), alpha=group["weight_decay"])
    b = group["momentum"]
    buf = state.get("momentum_buffer") if b else None
    if buf is not None:  # v = b buf + (1 - dampening) g; Nesterov: g + b v
        if group["nesterov"]:
            grad.mul_(1 + b * (1 - group["dampening"])).add_(buf, alpha=b * b)
        else:
            grad.mul_(1 - group["dampening"]).add_(buf, alpha=b)
    elif b and group["nesterov"]:  # first step: v = g, so g + b v = (1 + b) g
        grad.mul_(1 + b)
    return grad.mul_(-_scalar(group["lr"]))


def _adam(optimizer: torch.optim.Optimizer, group: dict[str, Any], state: dict[str, Any],
          param: Tensor, grad: Tensor) -> Tensor:
    g = -grad if group.get("maximize", False) else grad
    w = param.detach()
    lr, wd = _scalar(group["lr"]), group["weight_decay"]
    decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
    if wd and not decoupled:
        g = g + wd * w
    beta1, beta2 = (_scalar(b) for b in group["betas"])
    k = _scalar(state["step"]) + 1
    m = beta1 * state["exp_avg"] + (1 - beta1) * g
    v = beta2 * state["exp_avg_sq"] + (1 - beta2) * g * g
    if group.get("amsgrad", False) and "max_exp_avg_sq" in state:
        v = torch.maximum(state["max_exp_avg_sq"], v)
    denom = (v / (1 - beta2 ** k)).sqrt_().add_(group["eps"])
    update = -(lr / (1 - beta1 ** k)) * m / denom
    if wd and decoupled:
        update = update - lr * wd * w
    return update


def _scalar(x: Any) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)
