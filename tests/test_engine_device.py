"""Device discipline on the CPU: every tensor a collective receives is where it should be.

On an NCCL group a CPU tensor (or one of another CUDA device) is rejected, so a control
tensor created without the group's device breaks the GPU path only. This test catches such
tensors without a GPU: every registered algorithm trains a float64 model (so a tensor made
with the default float32 dtype stands out) on 2 ranks with the ``torch.distributed``
collectives wrapped to record the device, dtype and contiguity of each tensor they receive.
Allowed: the gradients' device, contiguous, and a dtype among the model's, the control
dtype (``hexagram.comm.device.CONTROL_DTYPE``), bytes (packed payloads) and the 16-bit wire
formats of the compressors that sum in fp16/bf16.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hexagram.launch import run_local

_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_to_all_single", "reduce",
                "reduce_scatter_tensor", "all_gather_into_tensor", "gather", "scatter",
                "send", "recv", "isend", "irecv")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dist.P2POp):
        return [value.tensor]
    return []


def _recording(name: str, fn: Callable[..., Any], log: list[tuple[str, str, str, bool]]
               ) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for t in _tensors(list(args) + list(kwargs.values())):
            log.append((name, str(t.device), str(t.dtype), t.is_contiguous()))
        return fn(*args, **kwargs)
    return wrapper


def _record_collectives() -> list[tuple[str, str, str, bool]]:
    log: list[tuple[str, str, str, bool]] = []
    for name in (*_COLLECTIVES, "batch_isend_irecv"):
        if name in ("isend", "irecv"):
            continue  # P2POp checks its op by identity: batch_isend_irecv sees their tensors
        setattr(dist, name, _recording(name, getattr(dist, name), log))
    return log


def _worker() -> dict[str, list[tuple[str, str, str, bool]]]:
    from _every_algorithm import small_model, train_steps

    import hexagram as hx

    rt = hx.init()
    log = _record_collectives()
    seen = {}
    for name in hx.algorithms.names():
        del log[:]
        ddp = train_steps(name, small_model().double(), rt.device, dtype=torch.float64,
                          bucket_size_mb=0.001)
        ddp.synchronize()
        ddp.close()
        seen[name] = sorted(set(log))
    return seen


def test_collectives_get_tensors_of_the_right_device_dtype_and_layout() -> None:
    from hexagram.comm.device import CONTROL_DTYPE

    allowed = {str(d) for d in (torch.float64, CONTROL_DTYPE, torch.uint8, torch.float16,
                                torch.bfloat16)}
    for rank, seen in enumerate(run_local(_worker, 2, timeout=240)):
        assert set(seen) >= {"allreduce", "async", "decentralized", "powersgd"}
        for name, records in seen.items():
            assert records, f"{name}: no collective recorded (is the wrapping still in place?)"
            bad = [r for r in records if r[1] != "cpu" or r[2] not in allowed or not r[3]]
            assert not bad, f"rank {rank} {name}: (op, device, dtype, contiguous) {bad}"

