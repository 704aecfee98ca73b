"""PyTorch DDP's built-in communication hooks, run as the Hexagram algorithm that matches.

``model.register_comm_hook(state, hook)`` takes the hooks of
``torch.distributed.algorithms.ddp_comm_hooks`` a DDP script registers and replaces the
wrapper's algorithm (plain allreduce until then) by the one that sends the same bytes,
on Hexagram's own path (buckets, overlap, once-per-step checks):

==========================================  ==============================================
torch hook (state)                          Hexagram algorithm
==========================================  ==============================================
``default_hooks.allreduce_hook`` (group)    ``allreduce``
``default_hooks.fp16_compress_hook``        ``fp16`` (one 16-bit allreduce per bucket)
``default_hooks.bf16_compress_hook``        ``fp16`` with ``wire="bf16"``
``powerSGD_hook`` (``PowerSGDState``)       ``powersgd`` (layer-wise): ``rank``,
                                            ``start_iter``, ``error_feedback``,
                                            ``warm_start``, ``min_compression_rate``
``batched_powerSGD_hook`` (state)           ``powersgd`` with ``granularity="bucket"``
``fp16_compress_wrapper(h)``, ``bf16_...``  ``h``'s algorithm with ``cast="fp16"``/``"bf16"``
==========================================  ==============================================

Anything else (a user's own hook, ``post_localSGD_hook``, the quantization and debugging
hooks) is refused with one line naming ``algorithm=``: Hexagram runs its algorithms, not
arbitrary Python per bucket.

Example:
    >>> from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    >>> algorithm_for(None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
    ...               world_size=1).name
    'cast'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd_hooks

from hexagram.algorithms import registry
from hexagram.algorithms.base import Algorithm
from hexagram.errors import ConfigError

__all__ = ["ONCE", "CommHooks", "algorithm_for", "refused"]

#: PyTorch's error (a RuntimeError) for a second registration, word for word
ONCE = "register_comm_hook or register_builtin_comm_hook can only be called once."

_GROUP_HOOKS: dict[Callable[..., Any], tuple[str, dict[str, Any]]] = {
    default_hooks.allreduce_hook: ("allreduce", {}),
    default_hooks.fp16_compress_hook: ("fp16", {}),
    default_hooks.bf16_compress_hook: ("fp16", {"wire": "bf16"}),
}
_POWERSGD_HOOKS: dict[Callable[..., Any], str] = {
    powersgd_hooks.powerSGD_hook: "layer",
    powersgd_hooks.batched_powerSGD_hook: "bucket",
}
#: the inner function names of torch's cast wrappers -> Hexagram's cast
_CAST_WRAPPERS = {"fp16_compress_wrapper_hook": "fp16", "bf16_compress_wrapper_hook": "bf16"}


def refused(hook: Any) -> ConfigError:
    """The one-line error for a hook Hexagram does not run."""
    name = getattr(hook, "__qualname__", None) or type(hook).__name__
    return ConfigError(
        f"register_comm_hook({name}): Hexagram runs torch's allreduce, fp16/bf16 compress "
        "and PowerSGD hooks (and the fp16/bf16 wrappers around them), not other hooks; "
        "choose the communication with hexagram.DistributedDataParallel(..., algorithm=...) "
        "(hexagram.algorithms.names() lists them)")


def _check_group(group: Any, world_size: int, what: str) -> None:
    if group is not None and dist.get_world_size(group) != world_size:
        raise ConfigError(f"{what}: a process group of {dist.get_world_size(group)} ranks; "
                          f"Hexagram averages over all {world_size} ranks: pass None")


def _powersgd(state: Any, granularity: str, world_size: int) -> dict[str, Any]:
    """PowerSGDState -> ``powersgd``'s config (see the module docstring)."""
    if not isinstance(state, powersgd_hooks.PowerSGDState):
        raise ConfigError(f"the PowerSGD hook's state must be a torch PowerSGDState, got "
                          f"{type(state).__name__}")
    _check_group(state.process_group, world_size, "PowerSGDState.process_group")
    rate = 1.0 if granularity == "bucket" else state.min_compression_rate  # torch: no
    if rate < 1:  # rate for the batched hook, which always compresses the whole bucket
        raise ConfigError(f"PowerSGDState(min_compression_rate={rate}): Hexagram never "
                          "sends factors larger than the tensor; pass a value >= 1")
    return {"rank": state.matrix_approximation_rank, "error_feedback": state.use_error_feedback,
            "warm_start": state.warm_start, "min_compression_rate": float(rate),
            "start_iter": max(0, state.start_powerSGD_iter - state.iter),
            "granularity": granularity}


def _unwrap_cast(hook: Any) -> tuple[Any, str | None]:
    """(the hook inside torch's fp16/bf16 compress wrapper, its cast), or (hook, None)."""
    cast = _CAST_WRAPPERS.get(getattr(hook, "__name__", ""))
    code = getattr(hook, "__code__", None)
    if cast is None or code is None or "hook" not in code.co_freevars:
        return hook, None
    cell = hook.__closure__[code.co_freevars.index("hook")]
    return cell.cell_contents, cast


def algorithm_for(state: Any, hook: Any, world_size: int) -> Algorithm:
    """The Hexagram algorithm that runs torch's built-in ``hook`` with ``state``.

    Raises:
        ConfigError: a hook that is not one of torch's built-ins above, a state it cannot
            honour (a subgroup, ``min_compression_rate < 1``), or a cast that does not
            compose (the fp16 wrapper around the fp16 hook).
    """
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")  # torch's words
    inner, cast = _unwrap_cast(hook)
    wrapper = {} if cast is None else {"cast": cast}
    if inner in _GROUP_HOOKS:
        name, config = _GROUP_HOOKS[inner]
        _check_group(state, world_size, f"{inner.__name__}'s state")
        return registry.get(name, **config, **wrapper)
    if inner in _POWERSGD_HOOKS:
        config = _powersgd(state, _POWERSGD_HOOKS[inner], world_size)
        return registry.get("powersgd", **config, **wrapper)
    raise refused(hook)


class CommHooks:
    """``register_comm_hook`` of :class:`~hexagram.engine.ddp.DistributedDataParallel` (a
    mixin): the wrapper's state it reads is declared here, the wrapper sets it."""

    algorithm: Algorithm
    runtime: Any
    _algorithm_chosen: bool  # algorithm= was given at wrap time
    _comm_hook: Any
    _resources: Any
    _ctx: Any
    _reducer: Any
    _rebucketed: bool

    def _build(self, order: Any = None) -> None:
        raise NotImplementedError

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Run one of PyTorch's built-in DDP communication hooks, as the matching Hexagram
        algorithm (table in :mod:`hexagram.engine.comm_hooks`). Collective: every rank calls
        it, at most once, as with PyTorch DDP; best before the first forward (a PowerSGD
        warm-up counts from here, as ``PowerSGDState.iter`` does).

        Example::

            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
            model.register_comm_hook(ps.PowerSGDState(None, matrix_approximation_rank=2,
                                                      start_powerSGD_iter=10), ps.powerSGD_hook)

        Raises:
            RuntimeError: called a second time (PyTorch's error).
            ConfigError: another hook (use ``algorithm=``), a state it cannot honour, or a
                wrapper given ``algorithm=`` already.
        """
        if self._comm_hook is not None:
            raise RuntimeError(ONCE)
        if self._algorithm_chosen:
            raise ConfigError(
                f"register_comm_hook: this wrapper was given algorithm={self.algorithm.name!r}; "
                "a comm hook replaces PyTorch DDP's default allreduce: pass algorithm= or "
                "register the hook, not both")
        self._replace_algorithm(algorithm_for(state, hook, self.runtime.world_size))
        self._comm_hook = hook

    def _replace_algorithm(self, new: Algorithm) -> None:
        """Swap the (gradient) algorithm between steps: buckets and gradient hooks are
        rebuilt for ``new`` in the current bucket order, then ``new`` is set up."""
        reducer = self._reducer
        order = [(e.name, e.param) for b in reducer.buckets for e in b.entries] \
            if self._rebucketed and reducer is not None else None
        old = self.algorithm
        if old.is_set_up:
            old.close()
        self.algorithm = self._resources.algorithm = new
        self._build(order)
        new.setup(self._ctx)  # collective (PowerSGD makes a group for its Q allreduces)
