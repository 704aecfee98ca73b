"""Wrap-time consistency checks across ranks.

A model that differs across ranks (a parameter missing, a different shape or dtype) would
otherwise hang or corrupt a collective. Every rank gathers every rank's signature and raises
the same clear error naming the first differing parameter. Layers that cannot run where the
model is (SyncBatchNorm off the GPU) are refused at wrap time, not at the first forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hexagram.errors import ConfigError, ModelMismatchError

__all__ = ["check_runs_on", "check_same_model", "model_signature"]

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
