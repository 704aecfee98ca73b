"""Worker momentum for robust aggregation: each rank sends its momentum, not its gradient.

Robust aggregators separate attackers from honest ranks only as well as the honest vectors
agree. Stochastic-gradient noise makes them disagree; momentum at the *workers* averages
that noise over about ``1 / (1 - beta)`` steps before the aggregator sees it (Karimireddy,
He, Jaggi 2021 "Learning from history"; with NNM on non-IID data, Allouah et al. 2023). The
same momentum in the *optimizer* is applied after aggregation, too late to help it.

Two forms:

- taken over (``RobustConfig.momentum=None``, the default): plain momentum-SGD groups of the
  user's optimizer (no Nesterov, no dampening) give their ``momentum`` and ``weight_decay``
  to the workers and read 0 until the model is closed. Each rank sends
  ``m = beta m + (g + wd w)`` (``m = g + wd w`` at the first step), exactly the buffer
  ``torch.optim.SGD`` would have kept, so with the mean as aggregator training is unchanged
  (the mean of the momenta is the momentum of the means): a drop-in.
- explicit (``momentum=beta``): ``m = beta m + (1 - beta) g`` on top of whatever the optimizer
  does (for plain SGD optimizers, as in the papers).

Example:
    >>> import torch
    >>> from hexagram.buckets import Bucket
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    >>> wm = WorkerMomentum(None)
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:  # it warns that it took over
    ...     wm.take_over([opt], [("w", w)])
    >>> opt.param_groups[0]["momentum"]
    0.0
    >>> b = Bucket(0, [("w", w)])
    >>> _ = b.flat.fill_(1.0); wm.apply(b).tolist()
    [1.0, 1.0]
    >>> _ = b.flat.fill_(1.0); wm.apply(b).tolist()
    [1.899999976158142, 1.899999976158142]
    >>> wm.restore(); opt.param_groups[0]["momentum"]
    0.9
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hexagram.buckets import Bucket
from hexagram.optim.takeover import TakenMomentum, take_sgd_momentum

__all__ = ["WorkerMomentum"]


class WorkerMomentum:
    """Per-bucket momentum buffers of one rank; ``beta`` None: take the optimizer's over."""

    def __init__(self, beta: float | None) -> None:
        self.beta = beta
        #: per tensor name: (momentum, weight decay) taken from the optimizer
        self.factors: dict[str, tuple[float, float]] = {}
        self.buffers: dict[int, Tensor] = {}  # bucket index -> momentum (flat)
        self.views: dict[str, Tensor] = {}  # tensor name -> its taken-over momentum (a view)
        self._taken = TakenMomentum()  # the optimizer groups to give back

    def take_over(self, optimizers: Sequence[torch.optim.Optimizer],
                  named_params: Sequence[tuple[str, nn.Parameter]]) -> None:
        """With ``beta`` None, move plain momentum-SGD groups' momentum and weight decay
        to the workers (warned once); a no-op otherwise or when already taken."""
        if self.beta is not None or self._taken.groups:
            return
        self._taken = take_sgd_momentum(optimizers, named_params)
        self.factors.update(self._taken.factors)
        if self._taken.groups:
            warnings.warn(f"algorithm 'robust': took over the optimizer's SGD "
                          f"{self._taken.describe()} as "
                          "worker momentum (each rank sends its momentum, which the robust "
                          "aggregator needs; Karimireddy et al. 2021); its param_groups read "
                          "momentum=0, weight_decay=0 until the model is closed. Pass "
                          "robust momentum=0 to keep the optimizer's", UserWarning, stacklevel=3)

    def restore(self) -> None:
        """Give the optimizer its momentum and weight decay back."""
        self._taken.restore()

    def gain(self) -> float:
        """How much longer the sent vector is than a gradient once the momentum settles:
        ``1 / (1 - beta)`` for the optimizer's taken-over heavy-ball sum (its largest
        ``beta``), 1 for the exponential average and without momentum. Aggregators with an
        absolute radius (centered clipping's ``tau``, in gradient units) scale by it.

        >>> WorkerMomentum(0.9).gain()
        1.0
        """
        betas = [beta for beta, _ in self.factors.values()] if self.beta is None else []
        return 1.0 / (1.0 - max(betas, default=0.0))

    def apply(self, bucket: Bucket) -> Tensor:
        """The vector this rank sends for ``bucket``: its updated momentum (or the bucket's
        own buffer when there is no momentum). Not modified by the caller's send."""
        if self.beta is not None:
            return self._ema(bucket, self.beta)
        if not any(e.name in self.factors for e in bucket.entries):
            return bucket.flat
        m = self.buffers.get(bucket.index)
        first = m is None or m.shape != bucket.flat.shape
        if first:  # torch.optim.SGD's first buffer: the gradient itself
            m = self.buffers[bucket.index] = bucket.flat.detach().clone()
        assert m is not None
        for e in bucket.entries:
            beta, wd = self.factors.get(e.name, (0.0, 0.0))
            view = m[e.offset:e.offset + e.numel]
            if beta:
                self.views[e.name] = view
            if not first:
                view.mul_(beta).add_(bucket.flat[e.offset:e.offset + e.numel])
            if wd:
                view.add_(e.param.detach().reshape(-1), alpha=wd)
        return m

    def velocity(self, name: str) -> Tensor | None:
        """The taken-over momentum of tensor ``name`` (flat, this step's gradient included),
        or None where none was taken: what momentum-free SGD will step by (weight
        prediction, :meth:`hexagram.algorithms.base.Algorithm.predicted_gradient`)."""
        return self.views.get(name)

    def _ema(self, bucket: Bucket, beta: float) -> Tensor:
        if beta == 0.0:
            return bucket.flat
        m = self.buffers.get(bucket.index)
        if m is None or m.shape != bucket.flat.shape:
            m = self.buffers[bucket.index] = bucket.flat.detach().clone()
        else:
            m.mul_(beta).add_(bucket.flat, alpha=1 - beta)
        return m

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": {k: v.clone() for k, v in self.buffers.items()},
                "factors": dict(self.factors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffers = {int(k): v.clone() for k, v in state["buffers"].items()}
        self.factors.update(state.get("factors", {}))
