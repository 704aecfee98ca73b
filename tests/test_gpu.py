"""GPU tier (``-m gpu``): every algorithm on 1 and 2 GPUs with NCCL; compressors on CUDA.

Skipped, with the reason, where CUDA (or a second GPU) is absent; on a GPU machine these
run the code paths the CPU suite cannot: NCCL groups reject CPU tensors, so a control tensor
created off the group's device fails here first (the CPU-side guard is
``test_engine_device.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from hexagram.launch import run_local

pytestmark = pytest.mark.gpu


def _need_gpus(n: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (torch.cuda.is_available() is False)")
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, found {torch.cuda.device_count()}")


def _train_every_algorithm() -> dict[str, Any]:
    from _every_algorithm import small_model, train_steps

    import hexagram as hx

    rt = hx.init()
    out: dict[str, Any] = {"backend": rt.backend, "device": str(rt.device)}
    for name in hx.algorithms.names():
        net = small_model().to(rt.device)
        ddp = train_steps(name, net, rt.device, bucket_size_mb=0.001)
        ddp.synchronize()
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        mean = flat.clone()
        dist.all_reduce(mean)
        out[name] = {"spread": (flat - mean / rt.world_size).abs().max().item(),
                     "finite": bool(torch.isfinite(flat).all()),
                     "device": str(flat.device), "bytes": ddp.bytes_sent()}
        ddp.close()
    return out


@pytest.mark.parametrize("gpus", [1, 2])
def test_every_algorithm_trains_on_gpus_with_nccl(gpus: int) -> None:
    _need_gpus(gpus)
    import hexagram as hx

    for rank, out in enumerate(run_local(_train_every_algorithm, gpus, timeout=300)):
        assert out["backend"] == "nccl" and out["device"] == f"cuda:{rank}"
        for name in hx.algorithms.names():
            r = out[name]
            assert r["finite"] and r["device"] == f"cuda:{rank}", f"{name}: {r}"
            assert r["spread"] <= 1e-5, f"rank {rank} {name}: parameters differ {r}"
            if gpus > 1:
                assert r["bytes"] > 0, f"{name} sent nothing"


def test_compressors_round_trip_cuda_tensors() -> None:
    _need_gpus(1)
    import hexagram.compress as hc

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 33, device="cuda", generator=gen)
    for name in hc.names():
        c = hc.get(name)
        payload = c.compress(x)
        assert all(t.device == x.device for t in payload.tensors), name
        wire = payload.from_buffer(payload.to_buffer())
        y = c.decompress(wire)
        assert y.device == x.device and y.shape == x.shape, name
        assert torch.isfinite(y).all(), name
        assert torch.equal(y, c.decompress(payload)), f"{name}: wire round trip changed it"
