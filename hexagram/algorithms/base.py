"""The algorithm interface (BAGUA-style hooks) the engine calls.

An algorithm decides *what* is communicated (gradients or weights), *when* (per bucket
during backward, after backward, before the forward pass, after the optimizer step) and
*how* (which primitive, which compressor). The engine knows nothing else about it.

Life cycle, per training step::

    forward:   algorithm.need_reset()? (engine rebuilds buckets) -> algorithm.before_forward()
    backward:  for each bucket, when its last gradient is accumulated
                   handle = algorithm.bucket_ready(bucket)     # start async communication
               at the end of backward: engine waits every handle, writes results into .grad,
                   then algorithm.after_backward()
    step:      optimizer.step() -> algorithm.after_step(optimizer)

Gradient algorithms (``kind = "grad"``) return from ``bucket_ready`` a handle whose result is
the reduced flat buffer (same numel and dtype as ``bucket.flat``); the engine copies it into
the gradients. Weight algorithms (``kind = "weight"``) get no gradient hooks; the engine
builds buckets over the weights and hands them over in ``ctx.buckets`` for the algorithm to use
in ``before_forward`` / ``after_step``.

Example (a minimal gradient algorithm)::

    class SumThenAverage(Algorithm):
        def bucket_ready(self, bucket):
            return primitives.allreduce(self.ctx.comm, bucket.flat.clone(), average=True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from hexagram.algorithms.finite import StepChecks
from hexagram.buckets import Bucket
from hexagram.comm.communicator import Communicator, Handle
from hexagram.runtime import Runtime

if TYPE_CHECKING:
    from hexagram.cost.facts import Shapes
    from hexagram.cost.profile import TreeCost
    from hexagram.cost.schedule import Message, TensorSpec

__all__ = ["Algorithm", "AlgorithmContext", "Forwarding", "TensorKind"]

TensorKind = Literal["grad", "weight"]


@dataclass
class AlgorithmContext:
    """What the engine gives an algorithm at :meth:`Algorithm.setup`.

    Attributes:
        module: the wrapped module.
        optimizers: the optimizers passed to the wrapper (weight algorithms may step them).
        runtime: ranks, hosts, device, timeout.
        comm: communicator over all ranks for this algorithm's traffic.
        named_params: trainable parameters in registration order.
        buckets: the engine's buckets over :meth:`Algorithm.tensors` (rebuilt on reset).
        checks: non-finite conditions queued on the device during a step, read once at its
            end (:mod:`hexagram.algorithms.finite`); shared by an algorithm and its wrappers.
    """

    module: nn.Module
    optimizers: list[torch.optim.Optimizer]
    runtime: Runtime
    comm: Communicator
    named_params: list[tuple[str, nn.Parameter]]
    buckets: list[Bucket] = field(default_factory=list)
    checks: StepChecks = field(default_factory=StepChecks)


class Algorithm:
    """Base class of communication algorithms; every hook has a no-op default.

    Subclasses set ``name`` and ``kind``, hold their frozen config in ``self.config`` and all
    mutable state in explicit attributes returned by :meth:`state_dict`.
    """

    name: ClassVar[str] = ""
    kind: ClassVar[TensorKind] = "grad"
    #: CPU of its own outside the compressor the cost model adds (:meth:`own_work_cost`):
    #: ``"tree"`` replaces the decodes, ``"momentum"`` adds around encode and decode
    own_work: ClassVar[str] = ""
    #: what hides a weight algorithm's exchange: ``"forward"`` (the forward pass),
    #: ``"background"`` (a thread), ``""`` (nothing: it is exposed)
    exchange_overlap: ClassVar[str] = ""
    #: True where a NaN/Inf gradient on any rank reaches every rank's reduced gradient by
    #: the reduction itself (a plain sum); otherwise the engine checks gradients once per
    #: step around ``bucket_ready`` (:class:`hexagram.engine.checks.FiniteGuard`) and the
    #: algorithm never sees a non-finite value
    passes_nonfinite: ClassVar[bool] = False
    #: True where the reduction itself treats a rank whose contribution holds NaN/Inf as
    #: Byzantine and leaves it out (``robust``): the engine then neither checks nor cleans
    #: gradients before it nor shares a per-step flag (a flag a Byzantine rank could lie
    #: in); it checks only what arrives, and the algorithm keeps its own state finite
    drops_nonfinite: ClassVar[bool] = False

    def __init__(self, config: Any = None) -> None:
        self.config = config
        self._ctx: AlgorithmContext | None = None

    @property
    def ctx(self) -> AlgorithmContext:
        if self._ctx is None:
            raise RuntimeError(f"algorithm {self.name!r} used before setup(); wrap the model "
                               "with hexagram.DistributedDataParallel first")
        return self._ctx

    @property
    def is_set_up(self) -> bool:
        """True once :meth:`setup` bound it to a wrapped model (a weight algorithm wrapped
        without optimizers waits for ``attach_optimizers``: its ``close()`` has nothing to
        release until then)."""
        return self._ctx is not None

    # -- set-up ---------------------------------------------------------------------
    def setup(self, ctx: AlgorithmContext) -> None:
        """Bind to a wrapped model. Collective: called on every rank at wrap time."""
        self._ctx = ctx

    def tensors(self, named_params: Sequence[tuple[str, nn.Parameter]]
                ) -> list[tuple[str, nn.Parameter]]:
        """Tensors to bucket, in launch order (default: trainable ones, reversed)."""
        return list(reversed(named_params))

    def need_reset(self) -> bool:
        """True to make the engine rebuild buckets/hooks before the next forward."""
        return False

    def bucket_size_bytes(self) -> int | None:
        """Bucket capacity (bytes) this algorithm wants, read whenever the engine (re)builds
        buckets (at wrap time, after the first backward, after :meth:`need_reset`); ``None``
        (the default) keeps the wrapper's ``bucket_size_mb``. ``auto`` tunes it."""
        return None

    def reset(self, ctx: AlgorithmContext) -> None:
        """Called after the engine rebuilt buckets because :meth:`need_reset` said so."""
        self._ctx = ctx

    # -- per-step hooks ---------------------------------------------------------------
    def before_forward(self) -> None:
        """Start work that overlaps the forward pass (e.g. decentralized weight exchange)."""

    def bucket_ready(self, bucket: Bucket) -> Handle[torch.Tensor] | None:
        """All of ``bucket``'s gradients are in ``bucket.flat``: start communicating them."""
        return None

    def after_backward(self) -> None:
        """Finish outstanding communication not returned as handles."""

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before ``optimizer.step()`` (``delay=1`` puts the true weights back here)."""

    def predicted_gradient(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """The gradient the optimizer most likely receives for tensor ``name`` next, given
        this rank's own gradient ``grad`` of this step (read by ``delay=1``'s weight
        prediction). Default: ``grad``; DGC, which keeps the optimizer's momentum itself,
        returns its velocity."""
        return grad

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()`` (weight-based algorithms communicate here)."""

    def synchronize(self) -> None:
        """Bring every rank to the same (averaged) weights. Collective. No-op for gradient
        algorithms, whose replicas never diverge."""

    # -- accounting, checkpoints, shutdown -------------------------------------------
    def bytes_sent(self) -> int:
        """Bytes this rank has sent for this algorithm since setup (all its communicators)."""
        return self.ctx.comm.counter.total

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (residuals, momenta, counters)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    def close(self) -> None:
        """Stop background work (threads); called by the wrapper's ``close()``."""

    # -- facts the cost model prices (hexagram.cost.facts.Priced) ----------------------
    @property
    def granularity(self) -> str:
        """``"bucket"`` if each bucket is encoded whole, ``"layer"``: tensor by tensor."""
        return str(getattr(self.config, "granularity", "layer"))

    def priced_as(self) -> Algorithm:
        """The algorithm whose messages this one sends (a delaying wrapper: its inner's)."""
        return self

    def wire_messages(self, bucket: Sequence[TensorSpec], world: int, rank: int
                      ) -> list[Message] | None:
        """One bucket's messages after any warm-up, where the protocol is the algorithm's
        own; ``None`` (the default): derived from its compressor's aggregation."""
        return None

    def step_messages(self, world: int, rank: int) -> list[Message]:
        """Messages of its own sent once per step, after the last bucket's (gTop-k's
        fault agreement); none by default."""
        return []

    def own_work_cost(self, sizes: Shapes, device: torch.device | str = "cpu"
                      ) -> TreeCost | None:
        """Its own CPU outside the compressor (:attr:`own_work`), timed at ``sizes``."""
        return None

    def gathered_decodes(self, world: int) -> int:
        """Payloads decoded per segment of a gathered format: all ``world`` of them."""
        return world


class Forwarding(Algorithm):
    """Base of wrappers around one algorithm: every hook is ``inner``'s unless overridden.

    A wrapper (one-step delay, attack injection) overrides only what it changes, so a hook
    added to :class:`Algorithm` reaches the inner algorithm through every wrapper at once.

    Example::

        class Logged(Forwarding):
            def bucket_ready(self, bucket):
                print(bucket.names)
                return self.inner.bucket_ready(bucket)
    """

    def __init__(self, inner: Algorithm) -> None:
        super().__init__(inner.config)
        self.inner = inner

    @property  # type: ignore[misc]
    def passes_nonfinite(self) -> bool:  # type: ignore[override]
        """The inner algorithm's: a wrapper sends what its inner algorithm reduces."""
        return self.inner.passes_nonfinite

    @property  # type: ignore[misc]
    def drops_nonfinite(self) -> bool:  # type: ignore[override]
        """The inner algorithm's (see :attr:`Algorithm.drops_nonfinite`)."""
        return self.inner.drops_nonfinite

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        self.inner.setup(ctx)

    def tensors(self, named_params: Sequence[tuple[str, nn.Parameter]]
                ) -> list[tuple[str, nn.Parameter]]:
        return self.inner.tensors(named_params)

    def need_reset(self) -> bool:
        return self.inner.need_reset()

    def bucket_size_bytes(self) -> int | None:
        return self.inner.bucket_size_bytes()

    def reset(self, ctx: AlgorithmContext) -> None:
        super().reset(ctx)
        self.inner.reset(ctx)

    def before_forward(self) -> None:
        self.inner.before_forward()

    def bucket_ready(self, bucket: Bucket) -> Handle[torch.Tensor] | None:
        return self.inner.bucket_ready(bucket)

    def after_backward(self) -> None:
        self.inner.after_backward()

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner.before_step(optimizer)

    def predicted_gradient(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        return self.inner.predicted_gradient(name, grad)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner.after_step(optimizer)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def bytes_sent(self) -> int:
        return self.inner.bytes_sent()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        self.inner.close()
