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


def _gloo_cuda_every_algorithm() -> dict[str, Any]:
    from _every_algorithm import small_model, train_steps

    import hexagram as hx

    rt = hx.init(backend="gloo", device="cuda")
    out: dict[str, Any] = {"device": str(rt.device)}
    for name in hx.algorithms.names():
        net = small_model().to(rt.device)
        ddp = train_steps(name, net, rt.device, bucket_size_mb=0.001)
        ddp.synchronize()
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        out[name] = {"finite": bool(torch.isfinite(flat).all()), "device": str(flat.device),
                     "sum": float(flat.double().sum())}
        ddp.close()
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_algorithm_on_several_ranks_of_one_gpu_over_gloo(ranks: int) -> None:
    """Multi-rank device bugs (a CPU control tensor, a thread on the wrong device) show on
    one GPU: several ranks share it, with CUDA tensors over gloo."""
    _need_gpus(1)
    import hexagram as hx

    outs = run_local(_gloo_cuda_every_algorithm, ranks, timeout=280)
    for name in hx.algorithms.names():
        for out in outs:
            assert out[name]["finite"] and out[name]["device"].startswith("cuda"), name
        if name not in ("async",):  # background rounds: replicas close, not identical
            sums = [out[name]["sum"] for out in outs]
            assert max(sums) - min(sums) <= 1e-3 * (1 + abs(sums[0])), f"{name}: {sums}"


def _multi_block_world_one() -> dict[str, Any]:
    from _every_algorithm import config_for, optimizer_for

    import hexagram as hx

    rt = hx.init()
    out: dict[str, Any] = {"backend": rt.backend}
    numel = 1 << 22  # past every compressor's block size (one pass per block on the CPU)
    for name in hx.algorithms.names():
        net = torch.nn.Linear(numel // 64, 64).to(rt.device)
        opt = optimizer_for(name, net.parameters(), lr=0.01)
        algo = hx.algorithms.get(name, **config_for(name))
        ddp = hx.DistributedDataParallel(net, [opt], algo, bucket_size_mb=64)
        for _ in range(2):
            ddp(torch.randn(4, numel // 64, device=rt.device)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        ddp.synchronize()
        out[name] = bool(torch.isfinite(net.weight).all())
        ddp.close()
    return out


def test_every_algorithm_at_world_one_on_nccl_with_large_buckets() -> None:
    _need_gpus(1)
    out = run_local(_multi_block_world_one, 1, timeout=280)[0]
    assert out.pop("backend") == "nccl"
    assert all(out.values()), out


def _cuda_checkpoint(path: str) -> dict[str, Any]:
    from _every_algorithm import small_model, train_steps

    import hexagram as hx

    rt = hx.init(backend="gloo", device="cuda")
    net = small_model().to(rt.device)
    ddp = train_steps("topk", net, rt.device, steps=2)
    state = {"model": ddp.state_dict(), "algo": ddp.algorithm_state_dict()}
    torch.save(state, f"{path}.{rt.rank}")
    loaded = torch.load(f"{path}.{rt.rank}", weights_only=False)
    ddp.load_algorithm_state_dict(loaded["algo"])
    ddp.load_state_dict(loaded["model"])
    devices = {str(t.device) for t in loaded["model"].values()}
    ddp.close()
    return {"devices": sorted(devices)}


def test_checkpoint_of_cuda_state_round_trips(tmp_path: Any) -> None:
    _need_gpus(1)
    for out in run_local(_cuda_checkpoint, 2, args=(str(tmp_path / "ckpt"),), timeout=120):
        assert all(d.startswith("cuda") for d in out["devices"]), out


def _groups_after_close() -> dict[str, bool]:
    from torch.distributed import distributed_c10d as c10d

    import hexagram as hx

    rt = hx.init()
    net = torch.nn.Linear(8, 2).to(rt.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ddp = hx.DistributedDataParallel(net, [opt], algorithm="topk")
    group = ddp.comm.group
    before = group in c10d._world.pg_map
    ddp.close()
    return {"before": before, "after": group in c10d._world.pg_map}


def test_a_closed_wrapper_destroys_its_nccl_group() -> None:
    _need_gpus(1)
    out = run_local(_groups_after_close, 1, timeout=120)[0]
    assert out == {"before": True, "after": False}, out


def test_live_mode_trains_a_cuda_model_over_gloo_and_heals_a_restarted_replica() -> None:
    """Live elastic mode with the model on the GPU (2 replicas sharing it): CUDA tensors
    over the epoch's gloo group, the control plane on the store; replica 1 is killed at
    step 4 and restarted, and heals from replica 0 (model, momentum, PowerSGD state)."""
    _need_gpus(1)
    from hexagram.bench.live import run_live

    results = run_live(world=2, steps=8, kill="1@4", restart=True, sleep=0.01, together=2,
                       algorithm="powersgd", config={"start_iter": 2, "rank": 1},
                       device="cuda", timeout=240)
    assert sorted(results) == [0, 1] and results[1]["restarted"]
    for rep in results.values():
        assert rep["device"].startswith("cuda") and "error" not in rep, rep.get("error")
    survivor, back = results[0], results[1]
    assert survivor["stats"]["failures"] >= 1 and back["stats"]["heal_s"]
    assert back["step"] == survivor["step"]
    assert torch.equal(back["params"], survivor["params"])  # trained the last steps together
