"""Where tensors that cross a process group live: one helper for every control tensor.

An NCCL group accepts only CUDA tensors (of the current device), a gloo group CPU ones
(gloo can move CUDA tensors, but slowly and not for every collective). Data tensors
(gradients, weights, payloads) already live where the model does; the small *control*
tensors (join flags, bucket orders, usage bitmaps) are created here, on the group's device,
so the same code runs on gloo/CPU and NCCL/GPU.

Control tensors are ``int64``: counts and flags stay exact, and a stray default-dtype
(float32) tensor stands out in the device-discipline test.

Example:
    >>> import torch.distributed as dist
    >>> group_device(None) if dist.is_initialized() else torch.device("cpu")
    device(type='cpu')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CONTROL_DTYPE", "control_tensor", "control_zeros", "group_device"]

#: dtype of every control tensor (flags, counts, orders).
CONTROL_DTYPE = torch.int64


def group_device(group: Any = None) -> torch.device:
    """The device whose tensors ``group`` (a ProcessGroup, ``None`` for the default group,
    or anything with a ``.group`` attribute, e.g. a Communicator) communicates.

    NCCL: the current CUDA device; gloo (and a single-process job): the CPU.
    """
    group = getattr(group, "group", group)
    if not dist.is_initialized():
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def control_tensor(values: Sequence[int | float | bool], group: Any = None) -> torch.Tensor:
    """A 1-D ``int64`` tensor of ``values`` on ``group``'s device (flags, counts, orders)."""
    return torch.tensor([int(v) for v in values], dtype=CONTROL_DTYPE,
                        device=group_device(group))


def control_zeros(n: int, group: Any = None) -> torch.Tensor:
    """``n`` zeros of the control dtype on ``group``'s device."""
    return torch.zeros(n, dtype=CONTROL_DTYPE, device=group_device(group))
