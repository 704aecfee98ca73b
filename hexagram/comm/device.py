"""Where tensors that cross a process group live, and threads that know their device.

An NCCL group accepts only CUDA tensors of the rank's device, a gloo group CPU tensors (and
CUDA tensors for the collectives it implements on CUDA, see :data:`GLOO_CUDA_REFUSES`). Data
tensors (gradients, weights, payloads) already live where the model does; every *other*
tensor handed to a collective (join flags, bucket orders, usage bitmaps, measured times)
is created here, on the group's device, so the same code runs on gloo/CPU, gloo/CUDA and
NCCL/GPU.

The group's device is the runtime's (``hexagram.init()`` chose it: ``cuda:<local_rank>``
with NCCL, or with ``init(backend="gloo", device="cuda")``), never
``torch.cuda.current_device()``: the current device is per thread, and is 0 in every thread
the library starts, so a tensor made there from the current device would land on GPU 0 on
every rank. :func:`start_thread` and :func:`device_initializer` make each library thread
set its device first, so the kernels it launches (snapshots, casts) run on the rank's GPU.

Control tensors are ``int64``: counts and flags stay exact, and a stray default-dtype
(float32) tensor stands out in the device-discipline test.

Example:
    >>> import torch.distributed as dist
    >>> group_device(None) if dist.is_initialized() else torch.device("cpu")
    device(type='cpu')
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hexagram import runtime

__all__ = [
    "CONTROL_DTYPE",
    "GLOO_CUDA_REFUSES",
    "control_tensor",
    "control_zeros",
    "device_initializer",
    "group_device",
    "group_tensor",
    "needs_host_staging",
    "set_thread_device",
    "start_thread",
]

#: dtype of every control tensor (flags, counts, orders).
CONTROL_DTYPE = torch.int64

#: Collectives torch's gloo backend cannot run on CUDA tensors (read in torch 2.x
#: ``ProcessGroupGloo.cpp``): ``allreduce_coalesced`` raises "unsupported device type";
#: ``allgather_coalesced`` / ``all_gather_into_tensor_coalesced`` flatten on the GPU and hand
#: gloo a device pointer (no staging through host memory); ``send``, ``recv`` (so ``isend``,
#: ``irecv``, ``batch_isend_irecv``) hand gloo's TCP transport the tensor's raw data pointer,
#: which must be host memory. gloo stages through pinned host memory, on CUDA, for
#: ``all_reduce``, ``broadcast``, ``reduce``, ``all_gather`` (and ``all_gather_into_tensor``),
#: ``gather``, ``scatter``, ``all_to_all_single``; ``reduce_scatter_tensor`` is an allreduce
#: and a copy (and always sums, whatever ``op``). Point-to-point exchanges on gloo+CUDA are
#: therefore staged through the CPU by :mod:`hexagram.comm.peers`.
GLOO_CUDA_REFUSES = ("allreduce_coalesced", "allgather_coalesced",
                     "all_gather_into_tensor_coalesced", "send", "recv", "isend", "irecv",
                     "batch_isend_irecv")


def _runtime_device() -> tuple[str, torch.device] | None:
    """``(backend, device)`` of ``hexagram.init()``'s runtime, or None before it."""
    if not runtime.is_initialized():
        return None
    rt = runtime.get_runtime()
    return str(rt.backend).lower(), rt.device


def group_device(group: Any = None) -> torch.device:
    """The device whose tensors ``group`` (a ProcessGroup, ``None`` for the default group,
    or anything with a ``.group`` attribute, e.g. a Communicator) communicates.

    NCCL: the runtime's CUDA device (the same from every thread); gloo: the CPU, or the
    runtime's CUDA device when the runtime itself is gloo on CUDA (several ranks on one
    GPU, for tests). Without a runtime (torch.distributed set up by hand): NCCL uses the
    calling thread's current CUDA device.
    """
    group = getattr(group, "group", group)
    if not dist.is_initialized():
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    chosen = _runtime_device()
    if "nccl" in backend:
        if chosen is not None and chosen[1].type == "cuda":
            return chosen[1]
        return torch.device("cuda", torch.cuda.current_device())
    if chosen is not None and "gloo" in chosen[0]:
        return chosen[1]  # the runtime's own device: CPU, or CUDA for gloo+CUDA
    return torch.device("cpu")


def control_tensor(values: Sequence[int | float | bool], group: Any = None) -> torch.Tensor:
    """A 1-D ``int64`` tensor of ``values`` on ``group``'s device (flags, counts, orders)."""
    return torch.tensor([int(v) for v in values], dtype=CONTROL_DTYPE,
                        device=group_device(group))


def control_zeros(n: int, group: Any = None) -> torch.Tensor:
    """``n`` zeros of the control dtype on ``group``'s device."""
    return torch.zeros(n, dtype=CONTROL_DTYPE, device=group_device(group))


def group_tensor(values: Sequence[float], group: Any = None,
                 dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A 1-D tensor of measured values (times, costs) on ``group``'s device, for a
    collective that agrees on them (``all_reduce`` MAX). Example:
    ``t = group_tensor([0.1, 0.2], comm); dist.all_reduce(t, op=MAX, group=comm.group)``."""
    return torch.tensor([float(v) for v in values], dtype=dtype, device=group_device(group))


def set_thread_device(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's current CUDA device (no-op off CUDA)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def device_initializer(device: torch.device | None = None) -> Callable[[], None]:
    """A thread-pool ``initializer`` that sets ``device`` (default: the default group's
    device, read now, in the creating thread) in each worker before any job."""
    chosen = device if device is not None else group_device(None)
    return lambda: set_thread_device(chosen)


def start_thread(target: Callable[[], Any], *, name: str,
                 device: torch.device | None = None) -> threading.Thread:
    """Start a daemon thread that sets its CUDA device (default: the default group's,
    read in the calling thread) before running ``target``.

    Every thread the library starts that touches tensors goes through this (or
    :func:`device_initializer` for pools): the current device is per thread.

    Example:
        >>> t = start_thread(lambda: None, name="hexagram-example"); t.join()
    """
    init = device_initializer(device)

    def run() -> None:
        init()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def needs_host_staging(tensor: torch.Tensor, group: Any = None) -> bool:
    """True when ``tensor`` must go through host memory for a point-to-point op on
    ``group``: a CUDA tensor on a gloo group (see :data:`GLOO_CUDA_REFUSES`)."""
    group = getattr(group, "group", group)
    return tensor.device.type == "cuda" and "gloo" in str(dist.get_backend(group)).lower()
