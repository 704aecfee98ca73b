"""Consistency checks: at wrap time across ranks, and the per-step non-finite check.

A model that differs across ranks (a parameter missing, a different shape or dtype) would
otherwise hang or corrupt a collective. Every rank gathers every rank's signature and raises
the same clear error naming the first differing parameter. Layers that cannot run where the
model is (SyncBatchNorm off the GPU) and a model on another device than the runtime's are
refused at wrap time, not at the first forward.

:class:`FiniteGuard` is the engine's non-finite gradient check (once per step, on the
device; see its docstring). Algorithms do not check gradients themselves: the engine calls
the guard around ``bucket_ready`` for every gradient algorithm whose ``passes_nonfinite`` is
False, so a NaN/Inf never reaches a compressor and an overflow reaches every rank's
``GradScaler``. It lives in :mod:`hexagram.engine.guard` and is re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from hexagram.engine.guard import FiniteGuard, agree_finite_grads, read_step_checks
from hexagram.errors import ConfigError, ModelMismatchError

__all__ = ["FiniteGuard", "agree_finite_grads", "at_end_of_backward", "check_model_device",
           "check_runs_on", "check_same_model", "fp16_autocast", "model_signature",
           "read_step_checks"]

Signature = list[tuple[str, tuple[int, ...], str, bool]]


def model_signature(module: nn.Module) -> Signature:
    """(name, shape, dtype, requires_grad) of every parameter and buffer, in order."""
    sig: Signature = [(f"param {n}", tuple(p.shape), str(p.dtype), p.requires_grad)
                      for n, p in module.named_parameters()]
    sig += [(f"buffer {n}", tuple(b.shape), str(b.dtype), False)
            for n, b in module.named_buffers()]
    return sig


def _first_difference(mine: Signature, ref: Signature) -> str | None:
    for i in range(max(len(mine), len(ref))):
        a = mine[i] if i < len(mine) else None
        b = ref[i] if i < len(ref) else None
        if a != b:
            def show(x: tuple[str, tuple[int, ...], str, bool] | None) -> str:
                return "nothing" if x is None else f"{x[0]} shape={list(x[1])} dtype={x[2]} " \
                    f"requires_grad={x[3]}"
            return f"entry {i}: {show(a)} vs rank 0's {show(b)}"
    return None


def check_same_model(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`ModelMismatchError` on every rank if any rank's model differs.

    Collective over ``group``: every rank must call it.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return
    sigs: list[Signature | None] = [None] * size
    dist.all_gather_object(sigs, model_signature(module), group=group)
    ref = sigs[0]
    assert ref is not None
    for rank, sig in enumerate(sigs):
        assert sig is not None
        diff = _first_difference(sig, ref)
        if diff is not None:
            raise ModelMismatchError(
                f"the model on rank {rank} differs from rank 0's ({len(sig)} vs {len(ref)} "
                f"parameters and buffers); first difference at {diff}. Build the same model "
                "on every rank before wrapping it")


def check_model_device(module: nn.Module, device: torch.device) -> None:
    """Raise :class:`ConfigError` naming both devices when a parameter or buffer of
    ``module`` is not on ``device`` (the one ``hexagram.init()`` chose).

    Example: a model left on the CPU under NCCL fails here, not inside a collective::

        hx.init(); model = hx.DistributedDataParallel(net.to(hx.get_runtime().device))
    """
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.device.type == "meta":
            continue  # deferred initialisation: materialised later by the user
        if t.device != device and not (t.device.type == device.type == "cpu"):
            raise ConfigError(
                f"{name!r} is on {t.device} but this rank communicates on {device} (the "
                f"device hexagram.init() chose); move the model first: "
                f"model.to(hexagram.get_runtime().device)")


def check_runs_on(module: nn.Module, device: torch.device) -> None:
    """Refuse layers that cannot run on ``device`` (the runtime's), naming the module.

    ``nn.SyncBatchNorm`` needs CUDA tensors and an NCCL group (PyTorch DDP refuses it with
    "SyncBatchNorm layers only work with GPU modules"); on the CPU it would fail only at
    the first forward pass.
    """
    if device.type == "cuda":
        return
    for name, m in module.named_modules():
        if isinstance(m, nn.SyncBatchNorm):
            raise ConfigError(
                f"SyncBatchNorm layers only work with GPU modules, and {name or 'the model'!r} "
                f"is one while this job runs on {device} (gloo). Use nn.BatchNorm on the CPU "
                "(convert back with a plain BatchNorm of the same shape), or run on CUDA "
                "with NCCL")


# -- mixed precision for weight algorithms ----------------------------------------------
def fp16_autocast(device_type: str) -> bool:
    """True inside ``torch.autocast(device_type, dtype=torch.float16)``: the forward of a
    mixed-precision step whose loss a ``GradScaler`` scales."""
    return torch.is_autocast_enabled(device_type) and \
        torch.get_autocast_dtype(device_type) == torch.float16


def at_end_of_backward(output: Any, callback: Callable[[], None]) -> bool:
    """Run ``callback`` once at the end of the backward pass that goes through ``output``
    (a tensor or a structure of them); False when no output tensor requires grad."""
    for leaf in tree_leaves(output):
        if isinstance(leaf, Tensor) and leaf.requires_grad:
            def queue(grad: Tensor) -> Tensor:
                torch.autograd.Variable._execution_engine.queue_callback(callback)
                return grad
            leaf.register_hook(queue)
            return True
    return False
