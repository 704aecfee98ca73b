"""Momentum correction (Lin et al. 2018, DGC) for any sparsifier with error feedback.

A sparsifier with error feedback sends each coordinate only every few steps, with the
gradients it accumulated meanwhile. Under the optimizer's heavy-ball momentum those sends
are stale gradients fed into a momentum of ``m``, which is stable only for learning rates
about ``(1 - m) / delay`` times smaller than synchronously (docs/benchmarks/delay.md
derives the one-step case): on Fashion-MNIST with SGD lr 0.05 momentum 0.9, random-k at
density 0.25 ended at 56.5 % against allreduce's 85.5 %. Momentum correction moves the
momentum before the sparsifier::

    u <- m * u + g (+ wd * w)      the velocity, accumulated locally
    v <- v + u                     v: the error-feedback residual; send a selection of v

and the optimizer steps without momentum on the mean of what was sent. At density 1 this is
exactly momentum SGD; below, a coordinate's velocity waits in ``v`` instead of a stale
gradient being amplified by the optimizer's momentum.

:class:`MomentumCorrection` is a mixin for a :class:`~hexagram.algorithms.compressed.
CompressorAlgorithm` whose config has ``momentum: float | None``. With ``momentum=None``
it *takes over* the momentum (and weight decay) of every plain momentum-SGD group (no
Nesterov, no dampening): those groups read momentum 0 and weight decay 0 until the wrapper
is closed, and a wrap-time warning says so; parameters of any other optimizer get momentum
0 (the sparsifier under the optimizer's own moments). An explicit ``momentum`` stacks on an
optimizer's momentum and is warned with its lr factor (:meth:`MomentumCorrection.lr_note`).

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("randomk").config.momentum is None   # taken over at wrap time
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hexagram.algorithms.base import AlgorithmContext
from hexagram.algorithms.compressed import Segment
from hexagram.algorithms.recipe import LrNote
from hexagram.buckets import BucketEntry
from hexagram.optim.takeover import TakenMomentum, take_sgd_momentum

__all__ = ["FlatVelocity", "MomentumCorrection", "entry_part"]


def entry_part(segment: Segment, flat: Tensor, entry: BucketEntry) -> Tensor:
    """``entry``'s slice of the segment's 1-D ``flat``."""
    start = entry.offset - segment.start
    return flat[start : start + entry.numel]


@dataclass(eq=False)
class FlatVelocity:
    """The velocities ``u`` of one bucket layout's tensors as views of one buffer, with
    what their update needs, built once per layout (:meth:`MomentumCorrection.
    bind_velocities`) so that a step's update is a few whole-buffer ops.

    Attributes:
        buffer: (numel,) every tensor's ``u`` end to end, in bucket order.
        names: the tensors' parameter names, in that order.
        views: each tensor's 1-D view of ``buffer`` (what ``momenta`` holds).
        momentum: the momentum of every tensor where they share one, else None.
        factors: each tensor's momentum (used where they differ).
        decay: per distinct weight decay: the velocities it applies to (shaped as their
            parameters) and those parameters.
        version: the algorithm's velocity version when built (stale once it moved on).
    """

    buffer: Tensor
    names: tuple[str, ...]
    views: list[Tensor]
    momentum: float | None
    factors: list[float]
    decay: list[tuple[float, list[Tensor], list[Tensor]]]
    version: int


class MomentumCorrection:
    """Mixin: the velocity ``u`` per tensor, the optimizer's momentum taken over; see the
    module doc. Put it before the algorithm base class (it calls ``super()``)."""

    name: ClassVar[str]
    config: Any
    ctx: AlgorithmContext

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: per tensor name: its velocity u (1-D); views of one buffer per bucket layout
        #: once bound (bind_velocities): replace them through load_state_dict only
        self.momenta: dict[str, Tensor] = {}
        #: per tensor name: (momentum, weight decay) of the correction (set at setup)
        self.factors: dict[str, tuple[float, float]] = {}
        self._taken = TakenMomentum()  # the optimizer groups to give back at close
        self._params: dict[str, Tensor] = {}
        #: bucket layout -> its velocities as one buffer (see bind_velocities)
        self._bound: dict[Hashable, FlatVelocity] = {}
        self._version = 0  # moved on whenever momenta, factors or parameters are replaced

    def setup(self, ctx: AlgorithmContext) -> None:
        """Set up; with ``momentum=None`` take the SGD momentum over (warned), else warn
        when the correction's momentum stacks on the optimizer's (:meth:`lr_note`)."""
        super().setup(ctx)  # type: ignore[misc]
        self._params = {n: p for n, p in ctx.named_params}
        self._version += 1  # factors and parameters may change below: rebind
        if self.factors:  # set up before (or restored from a checkpoint): keep
            return
        if self.config.momentum is None and self.takes_momentum_over():
            self._taken = take_sgd_momentum(ctx.optimizers, ctx.named_params)
            self.factors.update(self._taken.factors)
        if self._taken.groups:
            warnings.warn(
                f"algorithm {self.name!r}: took over the optimizer's SGD "
                f"{self._taken.describe()} as momentum correction (velocity accumulated "
                "before sparsifying, as DGC does); its param_groups read momentum=0, "
                "weight_decay=0 until the model is closed. Pass "
                f"{self.name} momentum=<float> with a momentum-free optimizer to set it "
                "yourself", UserWarning, stacklevel=2)
        note = self.lr_note(ctx.optimizers)
        if note:
            warnings.warn(note.message(self.name), UserWarning, stacklevel=2)

    def takes_momentum_over(self) -> bool:
        """Whether ``momentum=None`` takes the optimizer's momentum over (default: yes)."""
        return True

    def lr_note(self, optimizers: Sequence[torch.optim.Optimizer] = ()) -> LrNote | None:
        """The lr factor needed with ``optimizers``: an explicit ``momentum`` on top of an
        optimizer's momentum moves about ``1 / (1 - momentum)`` times as far; else None."""
        m = self.config.momentum
        stacked = [float(g.get("momentum", 0.0) or 0.0) for o in optimizers
                   for g in o.param_groups]
        if not m or not any(stacked):
            return None
        return LrNote(round(1.0 - m, 6), f"momentum={m:g} stacks momentum correction on the "
                      f"optimizer's momentum {max(stacked):g} (dgc on the digits MLP, SGD lr "
                      "0.05: 37% against 91.5% for allreduce); leave momentum unset (None, "
                      "the default) to take the optimizer's over, a drop-in")

    def velocities(self, segment: Segment, grad: Tensor) -> list[Tensor]:
        """u <- momentum * u + g (+ wd * w, taken over) per tensor of the segment
        (``grad``: the segment's 1-D view)."""
        return self._advance(segment.entries,
                             [entry_part(segment, grad, e) for e in segment.entries])

    def bind_velocities(self, key: Hashable, entries: Sequence[BucketEntry],
                        like: Tensor) -> FlatVelocity:
        """The velocities of ``entries`` (a bucket, end to end) as one buffer of ``like``'s
        dtype and device, cached under ``key`` (one bucket layout).

        Built on the first call for ``key`` and again once momenta, factors or parameters
        were replaced (checkpoint loaded, new set-up) or the dtype or device changed: the
        velocities found in ``momenta`` are copied in (zeros where none or of another size
        or dtype, as the per-tensor update starts them), and ``momenta`` then holds the
        buffer's views. Bindings of other keys over the same tensors are dropped (their
        velocities moved here: the engine re-formed its buckets).
        """
        bound = self._bound.get(key)
        if bound is not None and bound.version == self._version \
                and bound.buffer.dtype == like.dtype and bound.buffer.device == like.device:
            return bound
        bound = self._bind(entries, like)
        for old in [k for k, b in self._bound.items() if set(b.names) & set(bound.names)]:
            del self._bound[old]
        self._bound[key] = bound
        return bound

    def _bind(self, entries: Sequence[BucketEntry], like: Tensor) -> FlatVelocity:
        buffer = like.new_zeros(sum(e.numel for e in entries))
        default = (self.config.momentum or 0.0, 0.0)
        factors = [self.factors.get(e.name, default) for e in entries]
        views: list[Tensor] = []
        decay: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
        start = 0
        for e, (_, wd) in zip(entries, factors):
            view = buffer[start:start + e.numel]
            old = self.momenta.get(e.name)
            if old is not None and old.numel() == e.numel and old.dtype == like.dtype:
                view.copy_(old.reshape(-1))
            self.momenta[e.name] = view
            views.append(view)
            if wd and e.name in self._params:
                us, ws = decay.setdefault(wd, ([], []))
                us.append(view.view(e.shape))
                ws.append(self._params[e.name])
            start += e.numel
        ms = [m for m, _ in factors]
        return FlatVelocity(buffer, tuple(e.name for e in entries), views,
                            ms[0] if len(set(ms)) == 1 else None, ms,
                            [(wd, us, ws) for wd, (us, ws) in decay.items()], self._version)

    def accumulate(self, key: Hashable, entries: Sequence[BucketEntry], flat: Tensor,
                   residual: Tensor | None) -> FlatVelocity:
        """For every tensor of a bucket (``flat``: its 1-D buffer, holding the gradients;
        ``key``: its layout): ``u <- m u + g (+ wd w)``, then ``flat := u + residual``
        (``residual``: the bucket's error-feedback residuals end to end, or None where
        they are all zero). The arithmetic of :meth:`velocities` and a copy and an add per
        tensor, bit for bit, in a few whole-buffer ops (one ``_foreach`` per distinct
        weight decay); returns the bucket's velocities.

        Example:
            >>> import hexagram as hx
            >>> from hexagram.buckets import build_buckets
            >>> algo = hx.algorithms.get("dgc", momentum=0.5)
            >>> (b,) = build_buckets([("w", torch.nn.Parameter(torch.ones(2))),
            ...                       ("b", torch.nn.Parameter(torch.ones(1)))], 1 << 20)
            >>> for _ in range(2):
            ...     _ = b.flat.fill_(2.0)
            ...     u = algo.accumulate("layout", b.entries, b.flat, None)
            >>> b.flat.tolist(), algo.momenta["b"].tolist()  # u = 0.5 * 2 + 2
            ([3.0, 3.0, 3.0], [3.0])
        """
        u = self.bind_velocities(key, entries, flat)
        if u.momentum is not None:
            u.buffer.mul_(u.momentum)
        else:  # momenta differ per tensor (several optimizer groups)
            torch._foreach_mul_(u.views, u.factors)
        u.buffer.add_(flat)
        if u.decay:
            with torch.no_grad():  # parameters require grad; u does not
                for wd, us, ws in u.decay:
                    torch._foreach_add_(us, ws, alpha=wd)
        flat.copy_(u.buffer)
        if residual is not None:
            flat.add_(residual)
        return u

    def _advance(self, entries: Sequence[BucketEntry], grads: Sequence[Tensor]) -> list[Tensor]:
        """``u <- m u + g``, then ``u += wd w`` where taken over, for each entry: one
        ``_foreach`` op per step of the update (per distinct weight decay for the last)."""
        us: list[Tensor] = []
        ms: list[float] = []
        decays: dict[float, list[tuple[Tensor, Tensor]]] = {}
        default = (self.config.momentum or 0.0, 0.0)
        for e, g in zip(entries, grads):
            u = self.momenta.get(e.name)
            if u is None or u.shape != (e.numel,) or u.dtype != g.dtype:
                u = self.momenta[e.name] = g.new_zeros(e.numel)
                self._version += 1  # a bound buffer no longer holds it
            m, wd = self.factors.get(e.name, default)
            us.append(u)
            ms.append(m)
            if wd and e.name in self._params:
                decays.setdefault(wd, []).append((u, self._params[e.name].detach().reshape(-1)))
        if us:
            torch._foreach_mul_(us, ms)
            torch._foreach_add_(us, list(grads))
        for wd, pairs in decays.items():
            torch._foreach_add_([u for u, _ in pairs], [w for _, w in pairs], alpha=wd)
        return us

    def predicted_gradient(self, name: str, grad: Tensor) -> Tensor:
        """The velocity ``u`` (this step's gradient included): with the optimizer's momentum
        taken over, the next update is about ``-lr * u``, not ``-lr * grad``."""
        u = self.momenta.get(name)
        if u is None or self.factors.get(name, (self.config.momentum or 0.0, 0.0))[0] == 0:
            return grad
        return u.view_as(grad)

    def close(self) -> None:
        """Give the optimizer its momentum and weight decay back (module doc)."""
        self._taken.restore()
        self._bound.clear()
        super().close()  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "factors": dict(self.factors),  # type: ignore[misc]
                "momenta": {n: t.clone() for n, t in self.momenta.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # type: ignore[misc]
        self.momenta = {n: t.clone() for n, t in state["momenta"].items()}
        self.factors.update(state.get("factors", {}))
        self._version += 1  # rebind: the loaded velocities move into new buffers
