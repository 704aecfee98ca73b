"""Wrappers that compose with any gradient algorithm (compose, don't subclass).

- :class:`Hierarchical`: intra-host reduce to the host's leader, the wrapped algorithm
  between host leaders only (its collectives cross the slow inter-host links once per host
  instead of once per rank), intra-host broadcast of the result. ``fp16 + hierarchical``,
  ``powersgd + hierarchical``, ``topk + hierarchical``: no class per combination.
- :class:`~hexagram.algorithms.cast.Cast` (``cast="fp16"`` or ``"bf16"``): the wrapped
  algorithm reduces a 16-bit copy of each bucket (PyTorch's ``fp16_compress_wrapper``), e.g.
  PowerSGD with 16-bit factors. Error feedback is every compressed algorithm's
  ``error_feedback`` switch (``qsgd + error feedback``: ``get("qsgd",
  error_feedback=True)``), applied by :func:`hexagram.comm.reduce.reduce_many` whatever
  the compressor.
- :class:`~hexagram.algorithms.delay.Delayed` (``delay=1``): the optimizer steps on the
  previous step's reduced gradient while this step's reduction overlaps the next forward
  and backward (first step, last step and checkpoints: :mod:`hexagram.algorithms.delay`).

User API: :func:`wrap`, or the wrapper options of :func:`hexagram.algorithms.get`::

    hx.algorithms.get("powersgd", hierarchical=True, rank=4)
    hx.algorithms.wrap(hx.algorithms.get("fp16"), hierarchical=True)
    hx.algorithms.get("qsgd", delay=1, hierarchical=True)   # Delayed(Hierarchical(qsgd))
    hx.algorithms.get("powersgd", cast="bf16", hierarchical=True)  # Hierarchical(Cast(..))

The result on every rank is the mean over all ranks (the leader averages its host's
gradients, the wrapped algorithm averages over hosts; hosts must have equal rank counts).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import Tensor

from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.algorithms.cast import Cast, check_cast
from hexagram.algorithms.delay import Delayed, check_delay
from hexagram.buckets import Bucket
from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.hierarchical import HostGroups, broadcast_from_leader, reduce_to_leader
from hexagram.errors import ConfigError

__all__ = ["WRAPPER_OPTIONS", "Cast", "Delayed", "Hierarchical", "wrap"]

#: the options :func:`hexagram.algorithms.get` accepts for any gradient algorithm
WRAPPER_OPTIONS = ("hierarchical", "delay", "cast", "predict", "delay_warmup")


def wrap(algorithm: Algorithm, *, hierarchical: bool = False, delay: int = 0,
         cast: str | None = None, predict: bool | None = None,
         delay_warmup: int | None = None) -> Algorithm:
    """``algorithm`` wrapped as asked (unchanged when nothing is asked). From the inside
    out: ``cast`` (so that with ``hierarchical`` only the inter-host stage is 16-bit),
    ``hierarchical``, and ``delay=1`` outermost (the whole reduction is what it delays).
    ``predict`` (default True with ``delay=1``) runs each step at the predicted weights
    (:mod:`hexagram.algorithms.predict`); ``predict=False`` keeps plain stale SGD.
    ``delay_warmup`` synchronous steps come first (default: 100 with Adam/AdamW, else 0).

    Raises:
        ConfigError: a wrapper that needs a gradient algorithm around a weight algorithm,
            ``delay`` not in {0, 1}, ``predict`` without ``delay=1``, or a cast the
            algorithm cannot take (the message names the algorithm).

    >>> import hexagram as hx
    >>> type(wrap(hx.algorithms.get("topk"), hierarchical=True)).__name__
    'Hierarchical'
    >>> type(wrap(hx.algorithms.get("topk"), hierarchical=True, delay=1).inner).__name__
    'Hierarchical'
    """
    delay = check_delay(algorithm, delay)
    for option, value in (("predict", predict), ("delay_warmup", delay_warmup)):
        if value is not None and not delay:
            raise ConfigError(f"algorithm {algorithm.name!r}: {option} applies to delay=1 "
                              f"only; pass delay=1 or drop {option}")
    dtype = check_cast(algorithm, cast)
    if dtype is not None:
        algorithm = Cast(algorithm, dtype)
    if hierarchical is True:
        algorithm = Hierarchical(algorithm)
    elif hierarchical is not False:
        raise ConfigError(f"hierarchical must be True or False, got {hierarchical!r}")
    if not delay:
        return algorithm
    return Delayed(algorithm, predict=predict is not False, warmup=delay_warmup)


class Hierarchical(Algorithm):
    """Intra-host reduce -> ``inner`` between host leaders -> intra-host broadcast.

    Every rank's bucket is summed into its host's leader (the lowest rank), divided by the
    host size there (the inner algorithm sees one host-mean gradient per host), reduced by
    ``inner`` over the leaders, then broadcast to the host. The inner stage is chained on the
    intra-host reduce's handle, so the leaders issue it in bucket order.
    """

    name = "hierarchical"
    kind = "grad"

    def __init__(self, inner: Algorithm) -> None:
        if inner.kind != "grad":
            raise ConfigError(f"hierarchical wraps gradient algorithms; {inner.name!r} "
                              f"communicates {inner.kind}s (use it without hierarchical=True)")
        if getattr(inner.config, "hierarchical", False):
            raise ConfigError(f"{inner.name!r} is hierarchical already; wrap it once")
        super().__init__(inner.config)
        self.inner = inner
        self._intra: Communicator | None = None
        self._leaders: Communicator | None = None

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        rt = ctx.runtime
        if len({len(h) for h in rt.hosts}) != 1:
            raise ConfigError(f"hierarchical {self.inner.name!r} needs the same number of "
                              f"ranks on every host, got hosts {rt.hosts}")
        groups = HostGroups.from_runtime(rt)  # collective, on every rank
        self._intra = Communicator(groups.intra, rt.timeout, f"{self.inner.name}-intra")
        if groups.leaders is not None:
            self._leaders = Communicator(groups.leaders, rt.timeout, f"{self.inner.name}-hosts")
            self.inner.setup(self._inner_ctx(ctx))

    def _inner_ctx(self, ctx: AlgorithmContext) -> AlgorithmContext:
        assert self._leaders is not None
        return replace(ctx, comm=self._leaders)

    def need_reset(self) -> bool:
        return self._leaders is not None and self.inner.need_reset()

    def reset(self, ctx: AlgorithmContext) -> None:
        super().reset(ctx)
        if self._leaders is not None:
            self.inner.reset(self._inner_ctx(ctx))

    def tensors(self, named_params: Any) -> Any:
        return self.inner.tensors(named_params)

    def bucket_ready(self, bucket: Bucket) -> Handle[Tensor]:
        assert self._intra is not None
        intra, flat = self._intra, bucket.flat
        summed = reduce_to_leader(intra, flat)
        if self._leaders is None:
            return summed.then_wait(lambda _: broadcast_from_leader(intra, flat))

        def across_hosts(_: Tensor) -> Handle[Tensor]:
            flat.div_(intra.size)
            handle = self.inner.bucket_ready(bucket) or Handle.completed(flat)
            return handle.then_wait(lambda result: broadcast_from_leader(
                intra, flat if result is flat else flat.copy_(result)))

        return summed.then_wait(across_hosts)

    def after_backward(self) -> None:
        if self._leaders is not None:
            self.inner.after_backward()

    def bytes_sent(self) -> int:
        comms = [c for c in (self.ctx.comm, self._intra, self._leaders) if c is not None]
        return sum(c.counter.total for c in comms)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict() if self._leaders is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._leaders is not None and state.get("inner") is not None:
            self.inner.load_state_dict(state["inner"])

    def predicted_gradient(self, name: str, grad: Tensor) -> Tensor:
        return self.inner.predicted_gradient(name, grad) if self._leaders is not None else grad

    def close(self) -> None:
        if self._leaders is not None:  # the inner algorithm was set up on leaders only
            self.inner.close()
        for c in (self._intra, self._leaders):
            if c is not None:
                c.close()
