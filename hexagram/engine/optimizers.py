"""Optimizers given to the wrapper: framework wrappers unwrapped, late attachment, signature.

Frameworks create or wrap optimizers *after* the model is wrapped (Lightning's
``configure_optimizers``, Accelerate's ``AcceleratedOptimizer``, the Hugging Face Trainer's
``create_optimizer``). The engine therefore accepts ``optimizers=`` at wrap time *or* later
through ``model.attach_optimizers(*opts)``; an algorithm that counts optimizer steps
(local SGD, DiLoCo, decentralized, QAdam) is set up when its first optimizer arrives.

A framework wrapper is replaced by the torch optimizer it wraps (the engine hooks that
optimizer's ``step``, which the wrapper calls), from an explicit table of known wrappers;
anything else that is not a ``torch.optim.Optimizer`` is refused with the fix.

Example:
    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> unwrap_optimizer(opt) is opt
    True
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hexagram.algorithms.base import Algorithm
from hexagram.engine.eager import run_eagerly
from hexagram.errors import ConfigError

__all__ = ["KNOWN_WRAPPERS", "LATER", "expose_forward_signature", "needs_optimizers",
           "unwrap_optimizer", "unwrap_optimizers", "wrap_time_optimizers"]

#: ``optimizers=LATER``: the optimizers come through ``attach_optimizers`` (frameworks)
LATER = "later"

# (module, class name) of a framework's optimizer wrapper -> attribute holding the optimizer.
KNOWN_WRAPPERS: dict[tuple[str, str], str] = {
    ("accelerate.optimizer", "AcceleratedOptimizer"): "optimizer",
    ("lightning.pytorch.core.optimizer", "LightningOptimizer"): "_optimizer",
    ("pytorch_lightning.core.optimizer", "LightningOptimizer"): "_optimizer",
    ("lightning.fabric.wrappers", "_FabricOptimizer"): "_optimizer",
}


def _wrapped_attr(opt: Any) -> str | None:
    for cls in type(opt).__mro__:
        attr = KNOWN_WRAPPERS.get((cls.__module__, cls.__name__))
        if attr is not None:
            return attr
    return None


def unwrap_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` behind ``opt`` (itself, or inside known framework wrappers).

    Raises:
        ConfigError: ``opt`` is neither a torch optimizer nor a wrapper in
            :data:`KNOWN_WRAPPERS`.
    """
    seen = opt
    for _ in range(8):  # wrappers of wrappers (e.g. Lightning around Accelerate), bounded
        attr = _wrapped_attr(opt)
        if attr is None:
            break
        opt = getattr(opt, attr)
    if isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "_optimizer_step_post_hooks"):
        return opt
    raise ConfigError(
        f"optimizer of type {type(seen).__module__}.{type(seen).__qualname__} is neither a "
        "torch.optim.Optimizer nor a known framework wrapper "
        f"({', '.join(f'{m}.{c}' for m, c in KNOWN_WRAPPERS)}); pass the torch optimizer "
        "it wraps to hexagram.DistributedDataParallel(optimizers=[...]) or "
        "model.attach_optimizers(...)")


def unwrap_optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    """A list of torch optimizers from one optimizer, a wrapper, or an iterable of them."""
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer) or _wrapped_attr(optimizers) is not None:
        return [unwrap_optimizer(optimizers)]
    if not isinstance(optimizers, Iterable):
        return [unwrap_optimizer(optimizers)]  # raises the clear error
    return [unwrap_optimizer(o) for o in optimizers]


def needs_optimizers(algorithm: Algorithm) -> bool:
    """True if ``algorithm.setup`` needs an optimizer (it counts or hooks optimizer steps).

    The engine then defers ``setup`` until an optimizer is attached.
    """
    from hexagram.algorithms.qadam import QAdamAlgorithm
    from hexagram.algorithms.weight_sync import RoundAlgorithm

    return isinstance(algorithm, (RoundAlgorithm, QAdamAlgorithm))


def wrap_time_optimizers(optimizers: Any, algorithm: Algorithm) -> list[torch.optim.Optimizer]:
    """The wrapper's ``optimizers=``: optimizers (unwrapped), or :data:`LATER`.

    A weight algorithm (local SGD, DiLoCo, decentralized, QAdam: :func:`needs_optimizers`)
    wrapped without optimizers fails here, at wrap time, with the fix; ``"later"`` defers
    them to ``attach_optimizers`` (called before the first forward), as the framework
    integrations do, which create optimizers after wrapping.

    Example:
        >>> from hexagram.algorithms import registry
        >>> wrap_time_optimizers("later", registry.get("local_sgd"))
        []
    """
    if isinstance(optimizers, str):
        if optimizers == LATER:
            return []
        raise ConfigError(f"optimizers={optimizers!r}: pass a list of optimizers or "
                          f"optimizers={LATER!r} (then model.attach_optimizers(opt))")
    opts = unwrap_optimizers(optimizers)
    if not opts and needs_optimizers(algorithm):
        raise ConfigError(
            f"algorithm {algorithm.name!r} communicates after optimizer steps: pass "
            "optimizers=[opt] to hexagram.DistributedDataParallel (or optimizers='later' "
            "and call model.attach_optimizers(opt) before the first forward)")
    return opts


def expose_forward_signature(wrapper: nn.Module, module: nn.Module) -> None:
    """Make ``inspect.signature(wrapper.forward)`` that of ``module.forward``.

    Frameworks read the model's forward signature to choose inputs (the Hugging Face Trainer
    drops dataset columns the forward does not name); a wrapper's ``forward(*args,
    **kwargs)`` would hide them. The call still goes through the wrapper's class ``forward``.
    """
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # builtins or C extensions without a signature
        return
    # the function lives in the wrapper's __dict__: it must hold the wrapper weakly, or
    # wrapper -> forward -> wrapper is a cycle that only the cycle collector frees (with
    # every bucket and algorithm state the wrapper holds on the device)
    owner, method = weakref.ref(wrapper), type(wrapper).forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        target = owner()
        if target is None:
            raise ReferenceError("the hexagram wrapper this forward belonged to was freed")
        return method(target, *args, **kwargs)

    forward.__signature__ = signature  # type: ignore[attr-defined]
    forward.__doc__ = type(wrapper).forward.__doc__ or module.forward.__doc__
    # torch.compile enters here first: run this frame eagerly so that Dynamo compiles the
    # module's forward, not the engine's pre-forward work (see DistributedDataParallel)
    object.__setattr__(wrapper, "forward", run_eagerly(forward, recursive=False))
