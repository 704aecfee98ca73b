"""PyTorch DDP's constructor arguments, read into what Hexagram's wrapper does with them.

``hexagram.DistributedDataParallel`` takes every argument of
``torch.nn.parallel.DistributedDataParallel`` (torch 2.13), in the same order, so a DDP
script runs with only its import changed. :func:`resolve` gives each one its meaning in
Hexagram, or raises :class:`~hexagram.errors.ConfigError` naming the argument where it
cannot apply (a subgroup, mixed precision, delayed all-reduce of named parameters, ...).
Hexagram's own arguments (``optimizers=``, ``algorithm=``, ``bucket_size_mb=``,
``first_bucket_mb=``) are keyword-only; code that still passes optimizers (2nd) or the
algorithm (3rd) positionally keeps working, with a ``FutureWarning``.

Example:
    >>> import torch
    >>> net = torch.nn.Linear(2, 2)
    >>> opts = resolve(net, world_size=2, bucket_cap_mb=4.0)
    >>> opts.bucket_mb, opts.forward_sync_buffers, opts.gradient_as_bucket_view
    (4.0, True, True)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from hexagram.algorithms.base import Algorithm
from hexagram.errors import ConfigError

__all__ = ["ARGUMENTS", "DEFAULT_BUCKET_MB", "PREFIX", "WrapOptions", "has_bare_keys",
           "legacy_positionals", "module_device", "resolve", "to_device"]

#: PyTorch DDP's state-dict prefix: the wrapped module is its ``module`` attribute
PREFIX = "module."

#: the wrapper's arguments :func:`resolve` reads (torch DDP's but ``module``, and Hexagram's
#: bucket sizes)
ARGUMENTS = frozenset({
    "device_ids", "output_device", "dim", "broadcast_buffers", "init_sync", "process_group",
    "bucket_cap_mb", "find_unused_parameters", "check_reduction", "gradient_as_bucket_view",
    "static_graph", "delay_all_reduce_named_params", "param_to_hook_all_reduce",
    "mixed_precision", "device_mesh", "skip_all_reduce_unused_params", "bucket_cap_mb_list",
    "batched_grad_copy", "forward_sync_buffers", "bucket_size_mb", "first_bucket_mb"})

#: PyTorch DDP's bucket capacity when ``bucket_cap_mb`` is None (MiB).
DEFAULT_BUCKET_MB = 25.0

_REFUSED = {  # argument -> why Hexagram cannot apply it, and what to do instead
    "delay_all_reduce_named_params": "Hexagram buckets and reduces every parameter that "
    "needs a gradient through its algorithm; leave the parameters in the model's buckets "
    "(the first bucket is small, so communication starts early)",
    "param_to_hook_all_reduce": "it only serves delay_all_reduce_named_params, which "
    "Hexagram does not support",
    "mixed_precision": "Hexagram does not keep a low-precision copy of the parameters: use "
    "torch.autocast for compute and algorithm='fp16' (or a compressor) for the wire",
    "skip_all_reduce_unused_params": "an unused parameter contributes zeros (or keeps its "
    ".grad when no rank used it, with find_unused_parameters=True)",
}


@dataclass(frozen=True, kw_only=True)
class WrapOptions:
    """What the wrapper does, from torch's and Hexagram's arguments (see :func:`resolve`).

    Attributes:
        bucket_mb, first_bucket_mb: bucket capacities (MiB).
        find_unused_parameters: tolerate parameters without a gradient in a step.
        forward_sync_buffers: broadcast rank 0's buffers before each forward.
        init_sync: check the model and broadcast rank 0's parameters at wrap time.
        init_sync_buffers: include the buffers in that broadcast.
        gradient_as_bucket_view: each ``.grad`` is a view of its bucket.
        static_graph: the user promised the same graph (and unused set) every step.
        device_ids, output_device, dim: as torch's (None, None, 0 on the CPU).
        device: where inputs are moved before forward (``device_ids[0]``), or None.
    """

    bucket_mb: float
    first_bucket_mb: float
    find_unused_parameters: bool
    forward_sync_buffers: bool
    init_sync: bool
    init_sync_buffers: bool
    gradient_as_bucket_view: bool
    static_graph: bool
    device_ids: list[int] | None
    output_device: int | None
    dim: int
    device: torch.device | None


def _is_optimizers(value: Any) -> bool:
    """A list/tuple of optimizers (or framework wrappers of one), or one optimizer."""
    from hexagram.engine.optimizers import KNOWN_WRAPPERS

    def one(x: Any) -> bool:
        return isinstance(x, torch.optim.Optimizer) or any(
            (c.__module__, c.__name__) in KNOWN_WRAPPERS for c in type(x).__mro__)

    if isinstance(value, (list, tuple)):
        return bool(value) and all(one(x) for x in value)
    return one(value)


def _is_algorithm(value: Any) -> bool:
    if isinstance(value, Algorithm):
        return True
    if not isinstance(value, str):
        return False
    try:
        torch.device(value)  # "cuda:0" is torch's output_device
    except RuntimeError:
        return True
    return False


def legacy_positionals(device_ids: Any, output_device: Any, optimizers: Any,
                       algorithm: Any) -> tuple[Any, Any, Any, Any]:
    """(device_ids, output_device, optimizers, algorithm), moving optimizers passed as the
    2nd positional and an algorithm passed as the 3rd to their keywords (FutureWarning).

    Raises:
        ConfigError: the same value given both positionally and by keyword.
    """
    moved = []
    if _is_optimizers(device_ids):
        if optimizers is not None:
            raise ConfigError("optimizers given twice: as the 2nd positional argument (now "
                              "torch's device_ids) and as optimizers=; keep optimizers=")
        device_ids, optimizers = None, device_ids
        moved.append("optimizers=[...]")
    if _is_algorithm(output_device):
        if algorithm is not None:
            raise ConfigError("algorithm given twice: as the 3rd positional argument (now "
                              "torch's output_device) and as algorithm=; keep algorithm=")
        output_device, algorithm = None, output_device
        moved.append(f"algorithm={algorithm!r}" if isinstance(algorithm, str)
                     else "algorithm=...")
    if moved:
        warnings.warn(
            "hexagram.DistributedDataParallel now takes PyTorch DDP's positional arguments "
            "(module, device_ids, output_device, ...); pass " + " and ".join(moved) +
            " by keyword. Positional optimizers/algorithm will stop working in a later "
            "release", FutureWarning, stacklevel=3)
    return device_ids, output_device, optimizers, algorithm


def _devices(module: nn.Module, device_ids: Sequence[Any] | None, output_device: Any
             ) -> tuple[list[int] | None, int | None, torch.device | None]:
    """torch's rules: ``device_ids`` None or one CUDA device holding the whole module."""
    devices = {p.device for p in module.parameters()}
    if not device_ids:
        if output_device is not None:
            raise ConfigError(f"output_device={output_device!r} needs device_ids=[d] with "
                              "the module on CUDA device d (as PyTorch DDP)")
        return None, None, None
    if len(device_ids) != 1:
        raise ConfigError(f"device_ids={list(device_ids)!r}: one device per process (as "
                          "PyTorch DDP); start one rank per GPU with torchrun")
    index = torch.device("cuda", device_ids[0]) if isinstance(device_ids[0], int) \
        else torch.device(device_ids[0])
    if devices != {index}:
        raise ConfigError(f"device_ids={list(device_ids)!r} names {index}, but the module's "
                          f"parameters are on {sorted(map(str, devices))}: move it there "
                          "first (module.to(device)) or pass device_ids=None (CPU modules)")
    out = index.index if output_device is None else torch.device(
        "cuda", output_device).index if isinstance(output_device, int) \
        else torch.device(output_device).index
    return [int(index.index or 0)], out, index


def _buffers(broadcast_buffers: bool | None, forward_sync_buffers: bool | None
             ) -> tuple[bool, bool]:
    """(sync before each forward, sync at wrap time), torch 2.13's rules: the deprecated
    ``broadcast_buffers=False`` also skips the wrap-time sync; ``forward_sync_buffers``
    wins when both are given."""
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    value = True if broadcast_buffers is None else bool(broadcast_buffers)
    return value, value


def _bucket_mb(bucket_cap_mb: float | None, bucket_size_mb: float | None,
               bucket_cap_mb_list: Sequence[float] | None, first_bucket_mb: float
               ) -> tuple[float, float]:
    if bucket_size_mb is not None and bucket_cap_mb is not None \
            and bucket_size_mb != bucket_cap_mb:
        raise ConfigError(f"bucket_size_mb={bucket_size_mb} and bucket_cap_mb="
                          f"{bucket_cap_mb} disagree: they are the same setting; pass one")
    cap = bucket_cap_mb if bucket_cap_mb is not None else bucket_size_mb
    first = first_bucket_mb
    if bucket_cap_mb_list:  # torch: bucket i holds up to list[i] MiB, the last repeats
        caps = list(bucket_cap_mb_list)
        if len(set(caps[1:])) > 1 or cap is not None:
            raise ConfigError(f"bucket_cap_mb_list={caps!r}: Hexagram has a first bucket "
                              "and one capacity for the rest; pass [first, rest] or "
                              "first_bucket_mb= and bucket_cap_mb=")
        first, cap = caps[0], caps[-1]
    cap = DEFAULT_BUCKET_MB if cap is None else cap
    cap_name = "bucket_size_mb" if bucket_cap_mb is None and bucket_size_mb is not None \
        else "bucket_cap_mb"
    for name, value in ((cap_name, cap), ("first_bucket_mb", first)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name} must be a number >= 0 (MiB), got {value!r}")
    return float(cap), float(first)


def _check_group(process_group: Any, device_mesh: Any, world_size: int) -> None:
    """The wrapper averages over every rank: a group or 1-D mesh of all ranks is fine."""
    if process_group is not None and device_mesh is not None:
        raise ConfigError("process_group and device_mesh both given; pass one (as PyTorch DDP)")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ConfigError(f"device_mesh of {device_mesh.ndim} dimensions: only a 1-D mesh "
                              "(as PyTorch DDP); for DDP inside a 2-D mesh use "
                              "hexagram.parallel (FSDP2/TP) or PyTorch DDP")
        process_group = device_mesh.get_group(mesh_dim=0)
    if process_group is not None and dist.get_world_size(process_group) != world_size:
        raise ConfigError(
            f"process_group (or device_mesh) of {dist.get_world_size(process_group)} ranks: "
            f"Hexagram averages over all {world_size} ranks of the default group; data "
            "parallelism over a subgroup is not supported (leave process_group=None)")


def _check_refused(given: dict[str, Any]) -> None:
    for name, why in _REFUSED.items():
        value = given.get(name)
        if value is not None and value is not False:
            raise ConfigError(f"{name}={value!r} is not supported by "
                              f"hexagram.DistributedDataParallel: {why}")


def resolve(module: nn.Module, world_size: int, *,
            device_ids: Any = None, output_device: Any = None, dim: int = 0,
            broadcast_buffers: bool | None = None, init_sync: bool = True,
            process_group: Any = None, bucket_cap_mb: float | None = None,
            find_unused_parameters: bool = False, check_reduction: bool = False,
            gradient_as_bucket_view: bool = True, static_graph: bool = False,
            bucket_cap_mb_list: Sequence[float] | None = None, device_mesh: Any = None,
            forward_sync_buffers: bool | None = None, batched_grad_copy: bool = False,
            bucket_size_mb: float | None = None, first_bucket_mb: float = 1.0,
            **refused: Any) -> WrapOptions:
    """Validate torch's and Hexagram's arguments and say what the wrapper does with them.

    ``world_size``: the default group's; ``refused`` holds
    the arguments Hexagram only accepts at their default (``delay_all_reduce_named_params``,
    ``param_to_hook_all_reduce``, ``mixed_precision``, ``skip_all_reduce_unused_params``).
    ``batched_grad_copy`` is a copy-scheduling hint of PyTorch's reducer with no effect on
    results; Hexagram's reducer schedules its own copies (none with
    ``gradient_as_bucket_view``), so it is accepted and changes nothing.

    Raises:
        ConfigError: an argument that cannot apply, named with the fix.
    """
    del batched_grad_copy
    _check_refused(refused)
    if dim != 0:
        raise ConfigError(f"dim={dim}: Hexagram does not split inputs (each rank passes "
                          "its own batch, as PyTorch DDP with one device per process); "
                          "leave dim=0")
    if check_reduction:
        warnings.warn("check_reduction is deprecated in PyTorch DDP and has no effect",
                      FutureWarning, stacklevel=3)
    _check_group(process_group, device_mesh, world_size)
    ids, out, input_device = _devices(module, device_ids, output_device)
    forward_sync, init_buffers = _buffers(broadcast_buffers, forward_sync_buffers)
    cap, first = _bucket_mb(bucket_cap_mb, bucket_size_mb, bucket_cap_mb_list,
                            first_bucket_mb)
    return WrapOptions(bucket_mb=cap, first_bucket_mb=min(first, cap),
                       find_unused_parameters=bool(find_unused_parameters or static_graph),
                       forward_sync_buffers=forward_sync, init_sync=bool(init_sync),
                       init_sync_buffers=init_buffers,
                       gradient_as_bucket_view=bool(gradient_as_bucket_view),
                       static_graph=bool(static_graph), device_ids=ids, output_device=out,
                       dim=dim, device=input_device)


def module_device(module: nn.Module) -> torch.device | None:
    """The device of the module's first parameter (None: it has none)."""
    return next((p.device for p in module.parameters()), None)


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor of ``tree`` (nested args/kwargs) on ``device``, asynchronously, as
    PyTorch DDP moves inputs to ``device_ids[0]``."""
    return tree_map(lambda t: t.to(device, non_blocking=True)
                    if isinstance(t, torch.Tensor) else t, tree)


def has_bare_keys(state_dict: Mapping[str, Any], module: nn.Module) -> bool:
    """True when ``state_dict`` holds ``module``'s own keys (``weight``) rather than
    PyTorch DDP's (``module.weight``): some key lacks the prefix, or every key has it but
    only the unprefixed keys name entries of ``module`` (a module whose own child is
    called ``module``).

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> has_bare_keys(net.state_dict(), net), has_bare_keys({"module.weight": 0}, net)
        (True, False)
    """
    keys = list(state_dict)
    if not keys:
        return False
    if not all(k.startswith(PREFIX) for k in keys):
        return True
    own = set(module.state_dict(keep_vars=True))
    stripped = {k[len(PREFIX):] for k in keys}
    return not stripped & own and bool(set(keys) & own)
