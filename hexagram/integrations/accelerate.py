"""Hexagram with Hugging Face Accelerate: Accelerate prepares everything but the model.

Accelerate's ``prepare(model)`` wraps the model in PyTorch DDP; Hexagram's wrapper replaces
that. The recipe (``torchrun --nproc-per-node 2 train.py``)::

    from accelerate import Accelerator
    from hexagram.integrations.accelerate import prepare

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model, opt, loader = prepare(accelerator, model, opt, loader, algorithm="powersgd", rank=2)
    for batch in loader:
        with accelerator.accumulate(model):          # no_sync on non-final micro-batches
            accelerator.backward(model(**batch).loss)
            opt.step(); opt.zero_grad()              # AcceleratedOptimizer, as usual
    model.synchronize()                              # consensus weights (weight algorithms)
    accelerator.unwrap_model(model)                  # -> the user's model

:func:`prepare` moves the model to ``accelerator.device``, runs ``accelerator.prepare`` on
the other objects (optimizers, data loaders, schedulers), wraps the model with
``hexagram.DistributedDataParallel`` and attaches the prepared optimizers (each
``AcceleratedOptimizer`` is unwrapped to its torch optimizer). It also teaches Accelerate's
``extract_model_from_parallel`` (hence ``accelerator.unwrap_model``) to see through
Hexagram's wrapper. Passing a Hexagram-wrapped model to ``accelerator.prepare`` itself
raises :class:`hexagram.errors.ConfigError` (it would be wrapped again in PyTorch DDP).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from hexagram.errors import require

require("accelerate", extra="integrations", feature="hexagram.integrations.accelerate")

# ruff: noqa: E402  (the framework imports come after the one-line missing-extra check)
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

from hexagram.engine.ddp import DistributedDataParallel
from hexagram.integrations import wrap

__all__ = ["install_unwrap", "prepare", "unwrap"]


def unwrap(model: Any) -> Any:
    """The user's model inside a Hexagram wrapper (also one compiled with torch.compile);
    anything else unchanged."""
    inner = getattr(model, "_orig_mod", None)  # torch.compile(hexagram.DDP(m))
    if isinstance(inner, DistributedDataParallel):
        return inner.module
    return model.module if isinstance(model, DistributedDataParallel) else model


def install_unwrap() -> None:
    """Make ``accelerate``'s ``extract_model_from_parallel`` (used by ``unwrap_model``, and
    by transformers) unwrap Hexagram's wrapper first. Idempotent; :func:`prepare` calls it.

    Every module attribute bound to the function is replaced; a name a caller bound in its
    own local scope before this call keeps the original (look it up as
    ``accelerate.utils.extract_model_from_parallel`` or use ``accelerator.unwrap_model``).
    """
    import accelerate.utils.other as other

    original: Any = getattr(other, "extract_model_from_parallel")  # noqa: B009
    if getattr(original, "_hexagram", False):
        return

    @functools.wraps(original)
    def extract_model_from_parallel(model: Any, *args: Any, **kwargs: Any) -> Any:
        return original(unwrap(model), *args, **kwargs)

    extract_model_from_parallel._hexagram = True  # type: ignore[attr-defined]
    name = original.__name__
    for module in list(sys.modules.values()):  # every `from ... import` of the function
        if getattr(module, name, None) is original:
            setattr(module, name, extract_model_from_parallel)


def prepare(accelerator: Accelerator, model: nn.Module, *objects: Any,
            algorithm: Any = "allreduce", **config: Any) -> tuple[Any, ...]:
    """``accelerator.prepare(*objects)`` plus Hexagram's wrapper around ``model``.

    Args:
        accelerator: an ``accelerate.Accelerator`` (its process group is reused).
        model: the user's model (not yet wrapped by anything).
        *objects: optimizers, data loaders, schedulers: prepared by Accelerate.
        algorithm: a registered algorithm name or instance.
        **config: wrapper options (``bucket_size_mb``, ...) and algorithm fields
            (``rank=2`` for ``"powersgd"``, ``period=8`` for ``"local_sgd"``, ...).

    Returns:
        ``(wrapped_model, *prepared_objects)`` in the order given.
    """
    install_unwrap()
    prepared = accelerator.prepare(*objects) if objects else ()
    if len(objects) == 1:
        prepared = (prepared,)
    optimizers = [o for o in prepared if isinstance(o, AcceleratedOptimizer)]
    if isinstance(model, DistributedDataParallel):
        model.attach_optimizers(*optimizers)
        return (model, *prepared)
    wrapped = wrap(model.to(accelerator.device), algorithm, config,
                   optimizers=optimizers or "later")  # later: a second prepare() attaches
    return (wrapped, *prepared)
