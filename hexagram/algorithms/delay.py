"""One-step delayed gradients: any gradient algorithm's communication overlaps the next step.

:class:`Delayed` wraps a gradient algorithm (``kind == "grad"``, compressed ones included).
At step ``t`` the engine hands each ready bucket to :meth:`Delayed.bucket_ready`, which

1. takes the inner algorithm's reduction of that bucket from step ``t - 1`` (waiting it if
   it is still in flight: it had the whole forward and the backward up to this bucket);
2. copies step ``t``'s gradient into a stash buffer of its own and starts the inner
   algorithm's reduction on the stash (the inner algorithm sees every step's gradient
   exactly once, so error feedback, momenta and random streams stay correct);
3. writes step ``t - 1``'s reduced gradient into the engine's bucket, which the engine
   puts into ``.grad`` as usual.

So the optimizer's step ``t`` applies the mean gradient computed at the weights of step
``t - 1`` (one-step-stale SGD, as in pipelined SGD): with plain SGD,
``w[t+1] = w[t] - lr * mean_grad(w[t-1])``, and a step costs about max(compute,
communication) instead of compute plus the exposed tail of the last buckets.

The ends of the pipeline (nothing is lost, nothing is applied twice):

- **Step 0** (and the first step after :meth:`Delayed.synchronize`): no reduced gradient
  exists yet, so the optimizer receives a **zero gradient**. Plain SGD (with or without
  momentum, no dampening) leaves the weights and the momentum unchanged by it; weight decay
  and Adam's step counter still advance by one step. Step 0's gradient is applied at step 1.
- **The last step**: its reduced gradient is still pending when the loop ends.
  ``model.synchronize()`` (collective) waits every reduction in flight, writes the reduced
  gradients into ``.grad`` and calls ``step()`` then ``zero_grad()`` on every optimizer the
  wrapper knows, at their current learning rate; with no optimizer attached it leaves the
  gradients in ``.grad`` for the caller to step. The wrapper's ``close()`` (or garbage
  collection, or interpreter exit) does the same if ``synchronize()`` did not. After
  ``join()``, call ``synchronize()``. Every gradient of steps ``0 .. T-1`` is then applied
  exactly once.
- **Checkpoints**: :meth:`Delayed.state_dict` waits the reductions in flight and carries
  their results (per parameter name), so a run resumed from it continues bit-exactly.
- **Re-bucketing** (after the first step, or when the inner algorithm asks): reductions in
  flight are waited and kept per parameter name, then handed out in the new layout.

Convergence: a one-step-stale gradient halves the stable step size of plain SGD (on a
quadratic of curvature ``h``: ``lr h < 1`` instead of ``< 2``) but shrinks heavy-ball
momentum's 38-fold at ``b = 0.9`` (``lr h < 1 - b`` instead of ``< 2 (1 + b)``): measured
on Fashion-MNIST (4 ranks, 5 epochs, lr 0.05), plain stale heavy ball ends 12.5 points
below its synchronous run. So by default (``predict=True``) the wrapper runs each forward
and backward at the **predicted weights** of the step the gradient will be applied to
(:mod:`hexagram.algorithms.predict`): after every optimizer step it keeps the true weights
and moves the module to ``true + update(own gradient)``, computed from the optimizer's
state (SGD and Adam/AdamW exactly; others by repeating the last update); before the next
step it copies the true weights back. On the quadratic this is exactly synchronous heavy
ball; the step still overlaps communication, because the prediction uses the rank's own
gradient, not the mean on the wire. Consequences:

- between steps the module holds the rank's predicted weights (they differ across ranks
  by ``lr`` times the local gradient noise); :meth:`Delayed.synchronize` (and ``close()``)
  put the true weights back, equal on every rank, after applying the last gradient;
- :meth:`Delayed.state_dict` carries the true weights, so a checkpoint of the module's
  predicted weights plus the algorithm state resumes bit-exactly;
- cost: two more parameter-sized buffers (true weights, this step's own gradient);
- with Adam or AdamW the first 100 steps run synchronously by default (``delay_warmup``,
  :attr:`Delayed.warmup_steps`): time delayed runs after it;
- ``predict=False`` gives plain one-step-stale SGD (the hand-computed sequence of the
  tests); use it with an AMP ``GradScaler`` (the local gradient is still scaled when the
  prediction reads it) or when the evaluation must see exactly the true weights mid-run.

Multi-stage inner algorithms (PowerSGD, gTop-k, hierarchical) issue their later stages
when their handle is waited, i.e. at the next step's ``bucket_ready`` of that bucket: every
rank waits in bucket order, so collectives stay in the same order everywhere.

Example:
    >>> import hexagram as hx
    >>> algo = hx.algorithms.get("topk", delay=1, density=0.1)
    >>> type(algo).__name__, algo.inner.name, algo.predict
    ('Delayed', 'topk', True)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hexagram.algorithms.base import Algorithm, AlgorithmContext, Forwarding
from hexagram.algorithms.predict import predicted_update
from hexagram.buckets import Bucket
from hexagram.comm.communicator import Handle
from hexagram.errors import ConfigError

__all__ = ["ADAM_WARMUP", "DELAYS", "Delayed", "check_delay"]

#: the supported values of the ``delay`` wrapper option
DELAYS = (0, 1)
#: default synchronous steps before the delay starts with an Adam or AdamW optimizer
ADAM_WARMUP = 100

Key = tuple[str, ...]


def check_delay(algorithm: Algorithm, delay: Any) -> int:
    """``delay`` validated for ``algorithm`` (0 or 1), or a :class:`ConfigError` naming it."""
    if isinstance(delay, bool) or delay not in DELAYS:
        raise ConfigError(f"algorithm {algorithm.name!r}: delay must be 0 (synchronous) or 1 "
                          f"(apply each step the gradient reduced during the previous one), "
                          f"got {delay!r}")
    return int(delay)


class Delayed(Forwarding):
    """``inner``'s reduction of step ``t`` overlaps step ``t + 1``; the optimizer steps on
    step ``t - 1``'s reduced gradient (see the module docstring for the ends). With
    ``predict`` (default) forward and backward run at the predicted weights.

    Raises:
        ConfigError: ``inner`` communicates weights (local SGD, DiLoCo, async,
            decentralized already let replicas run ahead) or is delayed already.
    """

    name = "delayed"
    kind = "grad"

    def __init__(self, inner: Algorithm, predict: bool = True,
                 warmup: int | None = None) -> None:
        _check_inner(inner)
        if not isinstance(predict, bool):
            raise ConfigError(f"algorithm {inner.name!r}: predict must be True or False, got "
                              f"{predict!r}")
        if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, int)
                                   or warmup < 0):
            raise ConfigError(f"algorithm {inner.name!r}: delay_warmup must be an integer >= 0 "
                              f"(synchronous steps before the delay starts) or None "
                              f"({ADAM_WARMUP} with Adam, else 0), got {warmup!r}")
        super().__init__(inner)
        self.predict = predict
        self._warmup = warmup
        self._steps = 0  # backward passes seen (the warm-up counts them)
        self._stash: dict[Key, list[Bucket]] = {}  # two per layout: in flight / next
        self._flip: dict[Key, int] = {}
        self._inflight: dict[Key, tuple[Bucket, Handle[Tensor]]] = {}
        self._ready: dict[str, Tensor] = {}  # reduced, not yet applied, by parameter name
        self._local: dict[Key, Tensor] = {}  # this step's own gradient, per bucket layout
        self._fresh: dict[str, Tensor] = {}  # ... by parameter name, until the next step
        self._true: dict[str, Tensor] = {}  # true weights while the module holds predicted

    def priced_as(self) -> Algorithm:
        """The inner algorithm: one step later, it sends the same messages."""
        return self.inner.priced_as()

    def reset(self, ctx: AlgorithmContext) -> None:
        Algorithm.reset(self, ctx)
        # the old layout's reductions finish and are kept by parameter name before the
        # inner algorithm rebuilds its per-bucket state
        self._materialize()
        self._stash.clear()
        self._flip.clear()
        self._local.clear()
        self.inner.reset(ctx)

    # -- the hook ------------------------------------------------------------------------
    @property
    def warmup_steps(self) -> int:
        """Synchronous steps before the delay starts: ``delay_warmup``, or by default
        :data:`ADAM_WARMUP` when an attached optimizer is Adam or AdamW (their first updates
        are sign-like, where the weight prediction is least accurate: the small GPT at
        AdamW lr 3e-3, 500 steps, ended 20 % above its synchronous validation loss without
        a warm-up, 5.0 % above with 50 steps, 3.3 % with 100; at lr 1e-3 0.5 % without),
        else 0 (heavy ball on Fashion-MNIST needs none)."""
        if self._warmup is not None:
            return self._warmup
        adam = any(isinstance(o, (torch.optim.Adam, torch.optim.AdamW))
                   for o in self.ctx.optimizers)
        return ADAM_WARMUP if adam else 0

    def after_backward(self) -> None:
        self.inner.after_backward()
        self._steps += 1

    def bucket_ready(self, bucket: Bucket) -> Handle[Tensor] | None:
        if self._steps < self.warmup_steps:  # synchronous: the inner reduction as is
            return self.inner.bucket_ready(bucket)
        key = tuple(bucket.names)
        previous = self._take(key, bucket)  # step t-1's reduction (may live in a stash)
        stash = self._next_stash(key, bucket)  # not the one ``previous`` may live in
        stash.flat.copy_(bucket.flat)
        if self._predicting():
            self._keep_local(key, bucket)
        if previous is None:
            bucket.flat.zero_()  # step 0: nothing reduced yet
        else:
            bucket.flat.copy_(previous)
        handle = self.inner.bucket_ready(stash) or Handle.completed(stash.flat)
        self._inflight[key] = (stash, handle)
        return Handle.completed(bucket.flat, "delayed")

    def _next_stash(self, key: Key, bucket: Bucket) -> Bucket:
        pair = self._stash.get(key)
        if pair is None:
            named = [(e.name, e.param) for e in bucket.entries]
            pair = self._stash[key] = [Bucket(bucket.index, named) for _ in range(2)]
        self._flip[key] = 1 - self._flip.get(key, 1)
        stash = pair[self._flip[key]]
        stash.index = bucket.index
        return stash

    def _take(self, key: Key, bucket: Bucket) -> Tensor | None:
        """The pending reduced gradient of ``bucket`` (None: there is none)."""
        if key in self._inflight:
            return self._inflight.pop(key)[1].wait()
        if not any(e.name in self._ready for e in bucket.entries):
            return None
        out = torch.zeros_like(bucket.flat)
        for e in bucket.entries:
            pending = self._ready.pop(e.name, None)
            if pending is not None:
                bucket.view(e, out).copy_(pending)
        return out

    def _materialize(self) -> None:
        """Wait every reduction in flight (in bucket order, the same on every rank) and
        keep its result per parameter name in ``_ready``."""
        for stash, handle in sorted(self._inflight.values(), key=lambda sh: sh[0].index):
            result = handle.wait()
            for e in stash.entries:
                self._ready[e.name] = stash.view(e, result).detach().clone()
        self._inflight.clear()

    # -- weight prediction (hexagram.algorithms.predict) --------------------------------
    def _predicting(self) -> bool:
        return self.predict and bool(self.ctx.optimizers)

    def _keep_local(self, key: Key, bucket: Bucket) -> None:
        """Keep this step's own gradient of ``bucket`` for the prediction after the step."""
        local = self._local.get(key)
        if local is None or local.shape != bucket.flat.shape:
            local = self._local[key] = torch.empty_like(bucket.flat)
        local.copy_(bucket.flat)
        for e in bucket.entries:
            self._fresh[e.name] = bucket.view(e, local).view_as(e.param)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the true weights back (bit for bit) before the optimizer applies a step."""
        self.inner.before_step(optimizer)
        if self._true:
            for name, param in self._params_of(optimizer):
                if name in self._true:
                    param.data.copy_(self._true[name])

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep the new true weights, then move the module to the predicted next ones."""
        self.inner.after_step(optimizer)
        if not self._predicting():
            return
        names = self._names
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    self._predict_one(optimizer, group, param, names.get(id(param)))

    def _predict_one(self, optimizer: torch.optim.Optimizer, group: dict[str, Any],
                     param: Tensor, name: str | None) -> None:
        local = None if name is None else self._fresh.pop(name, None)
        if name is None or local is None:
            self._true.pop(name or "", None)  # no gradient this step: weights stay true
            return
        hint = self.inner.predicted_gradient(name, local)
        # our own copy of the gradient may serve as scratch; an algorithm's state may not
        update = predicted_update(optimizer, group, param, hint, self._true.get(name),
                                  scratch=hint is local)
        # the true weights are kept even without an update to add: the fallback
        # prediction (the last update repeated) needs them one step later
        if name in self._true:
            self._true[name].copy_(param)
        else:
            self._true[name] = param.detach().clone()
        if update is not None:
            param.add_(update)

    @property
    def _names(self) -> dict[int, str]:
        """Parameter id -> name (built once per call site, not per parameter)."""
        return {id(p): n for n, p in self.ctx.named_params}

    def _params_of(self, optimizer: torch.optim.Optimizer) -> list[tuple[str, Tensor]]:
        names = self._names
        return [(names[id(p)], p) for g in optimizer.param_groups for p in g["params"]
                if id(p) in names]

    def _restore_all(self) -> None:
        """The true weights back into every parameter; prediction off until the next step."""
        with torch.no_grad():
            for name, param in self.ctx.named_params:
                if name in self._true:
                    param.copy_(self._true[name])
        self._true = {}
        self._fresh = {}

    # -- the last step ---------------------------------------------------------------------
    def pending(self) -> dict[str, Tensor]:
        """The reduced gradients not applied yet, by parameter name (waits those in flight;
        collective when reductions are in flight). Empty at step 0 and after a flush."""
        self._materialize()
        return dict(self._ready)

    def synchronize(self) -> None:
        """Apply the last pending reduced gradient: into ``.grad``, then ``step()`` and
        ``zero_grad()`` of every attached optimizer (none attached: left in ``.grad``).
        Collective. The next step starts the pipeline again (zero gradient)."""
        self.inner.synchronize()
        pending = self.pending()
        self._ready = {}
        self._restore_all()
        if not pending:
            return
        for name, param in self.ctx.named_params:
            if name in pending:
                param.grad = pending[name].view_as(param).clone()
        for opt in self.ctx.optimizers:
            opt.step()
            opt.zero_grad()

    # -- checkpoints, shutdown -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner state and the pending reduced gradients (waits those in flight)."""
        pending = self.pending()
        return {"delay": 1, "pending": {n: t.clone() for n, t in pending.items()},
                "true_weights": {n: t.clone() for n, t in self._true.items()},
                "steps": self._steps, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("delay") != 1 or "pending" not in state:
            raise ConfigError("this checkpoint was not written by a delay=1 algorithm; load "
                              "it into the algorithm without delay")
        self._materialize()  # let reductions in flight finish on every rank, then drop them
        device = self.ctx.runtime.device
        self._ready = {n: t.to(device) for n, t in state["pending"].items()}
        # the module's own state holds the predicted weights; these are the true ones
        self._true = {n: t.to(device) for n, t in state.get("true_weights", {}).items()}
        self._fresh = {}
        self._steps = int(state.get("steps", self._steps))
        self.inner.load_state_dict(state["inner"])

    def close(self) -> None:
        """Apply the pending gradient (as :meth:`synchronize`), then close ``inner``."""
        try:
            if self._ctx is not None and (self._inflight or self._ready):
                self.synchronize()
            elif self._ctx is not None:
                self._restore_all()
        finally:
            self.inner.close()


def _check_inner(inner: Algorithm) -> None:
    if isinstance(inner, Delayed):
        raise ConfigError(f"{inner.inner.name!r} is delayed already; pass delay=1 once")
    if inner.kind != "grad":
        raise ConfigError(
            f"delay=1 wraps gradient algorithms; {inner.name!r} communicates {inner.kind}s and "
            "already lets replicas run ahead of each other (local SGD, DiLoCo, async and "
            "decentralized delay by design): use it without delay")
    if getattr(inner.config, "allow_delay", False):
        raise ConfigError(f"{inner.name!r} with allow_delay=True may choose a weight "
                          "algorithm, which delay=1 cannot wrap; pass allow_delay=False")
