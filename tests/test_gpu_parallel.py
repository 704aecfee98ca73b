"""GPU tier (``-m gpu``): the planner's DTensor and FSDP2 plans, and ``algorithm="auto"``,
on CUDA at world 1 (NCCL) and on 2 ranks sharing one GPU (CUDA tensors over gloo).

Skipped, with the reason, where CUDA is absent (and the planner's tests where its solver,
``highspy`` or ``pulp``, is not installed). The CPU suite runs the same plans on gloo/CPU
(``test_parallel_exec.py``, ``test_parallel_zero.py``) and ``auto`` on 3 CPU ranks
(``test_auto.py``); here the parameters, gradients and the collectives DTensor, FSDP2 and
``auto``'s measurement issue are CUDA tensors. Pipelined plans are left out: their
point-to-point sends are refused by gloo on CUDA (``GLOO_CUDA_REFUSES``). DTensor and FSDP2
plans on CUDA over gloo are refused with a ConfigError naming NCCL (their coalesced
all-gather crashed both ranks with SIGSEGV there).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from hexagram.launch import run_local

pytestmark = pytest.mark.gpu

#: world size -> the backend of ``hexagram.init`` (NCCL allows one rank per GPU: the 2-rank
#: runs share the machine's GPU over gloo)
BACKENDS = {1: "nccl", 2: "gloo"}
TOL = 1e-5


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (torch.cuda.is_available() is False)")


def _need_solver() -> None:
    if not any(importlib.util.find_spec(m) for m in ("highspy", "pulp")):
        pytest.skip("the planner's solver is missing: install the planner extra "
                    "(highspy or pulp)")


def _init(backend: str, device: str) -> Any:
    import hexagram as hx

    return hx.init(backend=backend, device=device)


# -- the planner: DTensor (tensor parallel) and FSDP2 (ZeRO) on CUDA ------------------------
def _planned(backend: str, device: str, kind: str) -> dict[str, Any]:
    """``parity_worker`` (planned model vs. the unsharded one, float64) on ``device``:
    ``kind`` "tp" (DTensor column/row-wise; at world 1 the whole plan on one device) or
    "zero" (FSDP2 with Adam; world 2 and more)."""
    from hexagram.parallel import Cluster
    from hexagram.parallel.verify import ParitySpec, parity_worker

    rt = _init(backend, device)  # parity_worker's own hexagram.init() keeps this runtime
    world = rt.world_size
    if kind == "tp":  # slow compute, fast links: every matmul is split
        cluster = Cluster(hosts=1, devices_per_host=world, device_tflops=1e-6, dtype_bytes=8,
                          op_overhead_us=0.0)
        spec = ParitySpec(model="mlp", layers=2, hidden=16, constraints={"tp": world},
                          cluster=cluster, steps=3)
    else:  # 100 kB per device: only ZeRO-sharded state fits
        cluster = Cluster(hosts=1, devices_per_host=world, dtype_bytes=8, device_memory_gb=1e-4)
        spec = ParitySpec(model="mlp", layers=2, hidden=16, constraints={"dp": world},
                          cluster=cluster, optimizer="adam", lr=0.01, steps=3)
    out = parity_worker(spec)  # its "param_devices": where the local shards live
    out["device"] = str(rt.device)
    return out


@pytest.mark.parametrize("world, kind", [(1, "tp")])
def test_planned_model_on_cuda_matches_single_process(world: int, kind: str) -> None:
    _need_cuda()
    _need_solver()
    results = run_local(_planned, world, args=(BACKENDS[world], "cuda", kind), timeout=120)
    for r in results:
        assert r["device"].startswith("cuda"), r["device"]
        assert r["param_devices"] and all(d.startswith("cuda") for d in r["param_devices"]), r
        assert r["grad_diff"] < TOL and r["param_diff"] < TOL and r["loss_diff"] < TOL, r
    assert any(r["losses"][-1] is not None for r in results)
    if world > 1:  # DTensor and FSDP2 really shard: each rank holds about half
        assert all(r["local_params"] < 0.6 * r["stage_params"] for r in results), results


@pytest.mark.parametrize("kind", ["tp", "zero"])
def test_dtensor_plans_on_cuda_over_gloo_are_refused(kind: str) -> None:
    """Every rank raises the same one-line ConfigError naming NCCL, none crashes."""
    _need_cuda()
    _need_solver()
    results = run_local(_planned, 2, args=("gloo", "cuda", kind), timeout=120,
                        allow_failures=True)
    for r in results:
        assert isinstance(r, str) and "ConfigError" in r and "NCCL" in r, r


# -- algorithm="auto" on CUDA ------------------------------------------------------------
def _auto(backend: str, device: str) -> dict[str, Any]:
    """12 steps of ``auto`` (its probe, the timed near-ties on CUDA events, the delegate)."""
    import hexagram as hx

    rt = _init(backend, device)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                              torch.nn.Linear(256, 8)).to(rt.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    algo = hx.algorithms.get("auto", candidates=["allreduce", "fp16", "topk", "powersgd"],
                             probe_budget_s=0.5, tie=10.0, verbose=False)
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)
    gen = torch.Generator(device=rt.device).manual_seed(rt.rank)
    for _ in range(12):
        x = torch.randn(32, 64, device=rt.device, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    out = {"label": algo.label, "decided": algo.decision is not None,
           "device": str(flat.device), "finite": bool(torch.isfinite(flat).all()),
           "sum": float(flat.double().sum())}
    model.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_auto_decides_and_trains_on_cuda(world: int) -> None:
    _need_cuda()
    outs = run_local(_auto, world, args=(BACKENDS[world], "cuda"), timeout=120)
    for out in outs:
        assert out["decided"] and out["label"] in ("allreduce", "fp16", "topk", "powersgd"), out
        assert out["finite"] and out["device"].startswith("cuda"), out
    assert len({out["label"] for out in outs}) == 1, outs  # one decision on every rank
    sums = [out["sum"] for out in outs]
    assert max(sums) - min(sums) <= 1e-4 * (1 + abs(sums[0])), sums  # same replicas
