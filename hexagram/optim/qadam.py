"""QAdam: Adam whose second moment is frozen after a warm-up (the 1-bit Adam / QAdam family).

During the first ``warmup_steps`` steps this is Adam (with bias correction). After it, the
bias-corrected variance ``v_hat = v / (1 - beta2^warmup_steps)`` is frozen, so the update
``lr * m_hat / (sqrt(v_hat) + eps)`` is linear in the momentum ``m``. That is what lets the
``qadam`` algorithm communicate a compressed momentum instead of gradients: averaging
momenta over ranks then averages the updates. The optimizer is usable on its own (it is
Adam with a frozen variance); with ``algorithm="qadam"`` the gradient it receives after the
warm-up is the one that makes its momentum equal the ranks' averaged compressed momentum.

Variance floor: an element that received no (or almost no) gradient during the warm-up, e.g.
a weight of a ReLU unit that was dead on every warm-up batch, has ``v_hat ~ 0`` and a frozen
denominator ``~ eps``. Adam would re-estimate its variance as soon as gradients arrive; with
the variance frozen the first non-zero gradient ``g`` gives a step of ``lr * m / eps`` (about
``1e5 * lr * g`` with ``eps = 1e-8``) and training diverges within a few steps (and with
``qadam`` the preconditioned momentum ``m / d`` of that element blows up the quantization
range of its whole bucket). So at freezing time each tensor's variance is clamped from below
to ``variance_floor * mean(v_hat of the tensor)``: given a gradient of the tensor's typical
(RMS) size, such an element then steps about ``lr / sqrt(variance_floor)`` (10 x lr with the
default 0.01) per step instead of ``1e5 x lr``. The floor is part of the frozen ``v_hat``
(saved in the state dict), identical on every rank because the warm-up variances are.

A step updates every parameter of a group at once (``_foreach_*`` ops: a handful of kernels
per group whatever the number of tensors), with the arithmetic of a per-tensor Adam step.

Example:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> opt = QAdamOptimizer([p], lr=0.1, warmup_steps=1)
    >>> p.grad = torch.ones(2); opt.step(); opt.frozen
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from hexagram.errors import ConfigError

__all__ = ["QAdamOptimizer"]


class QAdamOptimizer(torch.optim.Optimizer):
    """Adam with the variance frozen after ``warmup_steps`` steps.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: (beta1, beta2) of the first and second moments, each in [0, 1).
        eps: added to the denominator.
        weight_decay: L2 penalty added to the gradient (as ``torch.optim.Adam``).
        warmup_steps: plain Adam steps before the variance freezes (>= 1); more => a
            better variance estimate, longer full-precision phase with ``qadam``.
        variance_floor: at freezing time each tensor's ``v_hat`` is clamped to at least this
            fraction of its mean (see the module doc); larger => smaller steps for elements
            that had no gradient during the warm-up (about ``lr / sqrt(floor)``) but also
            for legitimately quiet ones; 0 => Adam's frozen variance as is (diverges when a
            dead unit comes back to life).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, warmup_steps: int = 100,
                 variance_floor: float = 0.01) -> None:
        if not lr > 0:
            raise ConfigError(f"QAdamOptimizer.lr must be > 0, got {lr!r}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ConfigError(f"QAdamOptimizer.betas must be two numbers in [0, 1), got {betas!r}")
        if not eps > 0 or weight_decay < 0:
            raise ConfigError(f"QAdamOptimizer needs eps > 0 and weight_decay >= 0, got "
                              f"eps={eps!r}, weight_decay={weight_decay!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ConfigError(f"QAdamOptimizer.warmup_steps must be an integer >= 1, got "
                              f"{warmup_steps!r}")
        if not 0.0 <= variance_floor <= 1.0:
            raise ConfigError(f"QAdamOptimizer.variance_floor must be in [0, 1], got "
                              f"{variance_floor!r}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "variance_floor": variance_floor}
        super().__init__(params, defaults)
        self.warmup_steps = warmup_steps
        self.steps_done = 0
        # per parameter: (v_hat, its version, eps, sqrt(v_hat) + eps), see denominator()
        self._denominators: dict[Tensor, tuple[Tensor, int, float, Tensor]] = {}
        self._groups: dict[int, dict[str, Any]] = {}  # id(param) -> its group, see _group_of

    @property
    def frozen(self) -> bool:
        """True once the variance is frozen (after ``warmup_steps`` steps)."""
        return self.steps_done >= self.warmup_steps

    def momentum(self, p: Tensor) -> Tensor:
        """The first moment of ``p`` (zeros before its first step)."""
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["exp_avg"]  # type: ignore[no-any-return]

    def denominator(self, p: Tensor) -> Tensor:
        """``sqrt(v_hat) + eps`` of ``p``: frozen (and equal on every rank) once :attr:`frozen`.

        Read-only. Once frozen it is computed once and kept (the optimizer's step and the
        ``qadam`` algorithm need it every step; recomputing allocated a parameter-sized
        tensor twice per step); it is recomputed if ``v_hat`` or ``eps`` change (a loaded
        state, the variance floor applied in place).
        """
        return self._denominator(p, float(self._group_of(p)["eps"]))

    def _denominator(self, p: Tensor, eps: float) -> Tensor:
        state = self.state[p]
        if "v_hat" not in state:
            raise RuntimeError("QAdamOptimizer.denominator: the parameter has not stepped yet; "
                               "every parameter needs a gradient during the warm-up")
        v_hat = state["v_hat"]
        hit = self._denominators.get(p)
        if hit is not None and hit[0] is v_hat and hit[1] == v_hat._version and hit[2] == eps:
            return hit[3]
        denom = v_hat.sqrt().add_(eps)
        if self.frozen:
            self._denominators[p] = (v_hat, v_hat._version, eps, denom)
        return denom

    def frozen_terms(self, params: Sequence[Tensor]
                     ) -> tuple[list[Tensor], list[Tensor], list[float]]:
        """(momenta, denominators, beta1s) of ``params``, for the ``qadam`` algorithm's
        bucket-wide arithmetic (host work only: the denominators are cached once frozen)."""
        groups = [self._group_of(p) for p in params]
        return ([self.momentum(p) for p in params],
                [self._denominator(p, float(g["eps"])) for p, g in zip(params, groups)],
                [float(g["betas"][0]) for g in groups])

    def _group_of(self, p: Tensor) -> dict[str, Any]:
        """The param group holding ``p`` (a dict by identity, rebuilt when groups change)."""
        group = self._groups.get(id(p))
        if group is None or not any(q is p for q in group["params"]):
            self._groups = {id(q): g for g in self.param_groups for q in g["params"]}
            group = self._groups.get(id(p))
            if group is None:
                raise KeyError("parameter is not managed by this optimizer")
        return group

    def predicted_update(self, p: Tensor, grad: Tensor) -> Tensor | None:
        """What the next :meth:`step` would add to ``p`` if it received ``grad``; changes
        nothing (read by ``delay=1``'s weight prediction). None before ``p``'s first step."""
        state = self.state.get(p, {})
        if "exp_avg" not in state:
            return None
        group = self._group_of(p)
        beta1, beta2 = group["betas"]
        k = self.steps_done + 1
        g = grad if group["weight_decay"] == 0 else grad.add(p, alpha=group["weight_decay"])
        m = beta1 * state["exp_avg"] + (1 - beta1) * g
        if self.frozen and "v_hat" in state:
            denom = self.denominator(p)
        else:  # the next step is still Adam's: its variance moves too
            v = beta2 * state["exp_avg_sq"] + (1 - beta2) * g * g
            denom = (v / (1 - beta2 ** k)).sqrt_().add_(group["eps"])
        return m.div_(denom).mul_(-group["lr"] / (1 - beta1 ** k))

    def beta1(self, p: Tensor) -> float:
        """beta1 of the group holding ``p``."""
        return float(self._group_of(p)["betas"][0])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        frozen = self.frozen
        self.steps_done += 1
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(params, group, frozen)
        if self.steps_done == self.warmup_steps:  # the variance freezes now
            self._floor_variance()
        return loss

    def _floor_variance(self) -> None:
        """Clamp each frozen ``v_hat`` to ``variance_floor x`` its tensor's mean (module doc).

        A tensor whose mean is 0 (no gradient at all during the warm-up) takes the mean of
        the non-zero means of its group, so it too gets a bounded step."""
        for group in self.param_groups:
            hats = [self.state[p]["v_hat"] for p in group["params"] if "v_hat" in self.state[p]]
            # host reads (kept): once, when the variance freezes after the warm-up
            means = [float(h.mean()) if h.numel() > 0 else 0.0 for h in hats]
            nonzero = [m for m in means if m > 0]
            fallback = sum(nonzero) / len(nonzero) if nonzero else 0.0
            floor = float(group.get("variance_floor", self.defaults["variance_floor"]))
            for v_hat, mean in zip(hats, means):
                v_hat.clamp_(min=floor * (mean if mean > 0 else fallback))

    def _update(self, params: list[Tensor], group: dict[str, Any], frozen: bool) -> None:
        """One Adam step (variance frozen once ``frozen``) of ``params`` (one group, each
        with a gradient), in ``_foreach`` ops: per tensor, ``m <- beta1 m + (1 - beta1) g``;
        during the warm-up ``v <- beta2 v + (1 - beta2) g^2``, ``v_hat = v / (1 - beta2^t)``;
        ``p <- p - lr / (1 - beta1^t) * m / (sqrt(v_hat) + eps)``."""
        beta1, beta2 = group["betas"]
        grads: list[Tensor] | tuple[Tensor, ...] = [p.grad for p in params
                                                     if p.grad is not None]
        if group["weight_decay"] != 0:
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        moms = [self.momentum(p) for p in params]
        torch._foreach_mul_(moms, beta1)
        torch._foreach_add_(moms, grads, alpha=1 - beta1)
        fresh = [i for i, p in enumerate(params)  # Adam's variance; frozen after warm-up
                 if not frozen or "v_hat" not in self.state[p]]
        if fresh:
            vs = [self.state[params[i]]["exp_avg_sq"] for i in fresh]
            gs = [grads[i] for i in fresh]
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
            hats = torch._foreach_div(vs, 1 - beta2 ** self.steps_done)
            for i, v_hat in zip(fresh, hats):
                self.state[params[i]]["v_hat"] = v_hat
        correction1 = 1 - beta1 ** self.steps_done
        eps = float(group["eps"])
        denoms = [self._denominator(p, eps) for p in params]
        torch._foreach_addcdiv_(params, moms, denoms, value=-group["lr"] / correction1)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["steps_done"] = self.steps_done
        state["warmup_steps"] = self.warmup_steps
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.steps_done = int(state_dict.pop("steps_done"))
        self.warmup_steps = int(state_dict.pop("warmup_steps"))
        super().load_state_dict(state_dict)
