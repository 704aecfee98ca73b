"""Measured per-rank memory of a planned model: what ZeRO (FSDP2) really saves.

Two measurements, on every rank of a plan:

- :func:`state_bytes`: bytes of the rank's *local* parameter, gradient and optimizer-state
  storages right now (DTensors count their local shard; shared storages once).
- :func:`step_peak_bytes`: the peak, during one training step, of the bytes live in the
  device's allocator. GPU: ``torch.cuda.max_memory_allocated``. CPU: the allocation and
  free events of torch's CPU allocator recorded by ``torch.profiler`` (``profile_memory``),
  summed in time order; the result is the highest level reached above the level at the
  start of the step. It counts every tensor torch allocates (parameters gathered by FSDP,
  gradients, optimizer state and its temporaries, activations), not Python objects or
  gloo's own buffers (``tracemalloc`` sees neither torch's allocator nor gloo).

:func:`memory_worker` plans an MLP stack on the running ranks (data parallel, with or
without ZeRO), trains one warm-up step with Adam, then measures ``steps`` steps (3): the
per-rank peak of a step is the state live at its start plus the step's peak increase
(activations are kept under 1% of it by the model's shape); ``peak_bytes`` is the median
step's, ``step_peaks`` every step's.

Example:
    >>> from hexagram.launch import run_local
    >>> spec = MemorySpec(dp=4, zero=True)
    >>> ranks = run_local(memory_worker, 4, args=(spec, [memory_plan(spec)]))  # doctest: +SKIP
    >>> ranks[0][0]["state_after_step"]["params"]   # a quarter of the model # doctest: +SKIP
    4340240
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hexagram.parallel.plans import Plan

__all__ = ["MemorySpec", "memory_plan", "memory_worker", "state_bytes", "step_peak_bytes"]


def _storage(t: torch.Tensor) -> tuple[int, int]:
    local = t.to_local() if hasattr(t, "to_local") else t
    st = local.untyped_storage()
    return st.data_ptr(), st.nbytes()


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None
                ) -> dict[str, int]:
    """Local bytes of ``params``, ``grads`` and ``optimizer`` state (and their ``total``).

    Each storage is counted once (FSDP2 keeps a rank's shards of a module in one buffer).
    """
    seen: set[int] = set()

    def count(tensors: list[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            ptr, n = _storage(t)
            if ptr not in seen:
                seen.add(ptr)
                total += n
        return total

    params = list(module.parameters())
    out = {"params": count([p.detach() for p in params]),
           "grads": count([p.grad for p in params if p.grad is not None])}
    states = [v for s in (optimizer.state.values() if optimizer else ())
              for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    out["optimizer"] = count(states)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def _cpu_peak(step: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
              if e.name() == "[memory]" and "CPU" in str(e.device_type()).upper()]
    level = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        level += e.nbytes()
        peak = max(peak, level)
    return peak


def step_peak_bytes(step: Callable[[], object], device: torch.device) -> int:
    """Highest allocator level above the start reached while ``step()`` runs (bytes)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - start)
    return _cpu_peak(step)


@dataclass(frozen=True, kw_only=True)
class MemorySpec:
    """The measured run: an MLP stack planned data parallel over ``dp`` ranks.

    ``zero``: plan for devices too small for replicated training state (the planner then
    marks the linears ``+zero`` and FSDP2 shards them) or for roomy ones (plain dp).
    """

    dp: int = 4
    zero: bool = True
    layers: int = 4
    hidden: int = 256
    batch_per_rank: int = 2
    dtype: torch.dtype = torch.float64
    steps: int = 3


def _build(spec: MemorySpec) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    from hexagram.parallel.models import mlp_stack

    torch.manual_seed(0)
    model = mlp_stack(layers=spec.layers, hidden=spec.hidden, in_features=spec.hidden,
                      classes=8, dtype=spec.dtype)
    x = torch.randn(spec.batch_per_rank * spec.dp, spec.hidden, dtype=spec.dtype)
    return model, x, torch.randint(0, 8, (x.shape[0],))


def memory_plan(spec: MemorySpec) -> Plan:
    """The plan of ``spec`` (made once, in the launching process, for every rank)."""
    from hexagram.parallel.cluster import Cluster, Constraints
    from hexagram.parallel.planner import plan

    model, x, _ = _build(spec)
    params = sum(p.numel() for p in model.parameters())
    state = params * 8 * 4  # float64 params, grads, Adam's two moments
    # ZeRO: a quarter of the state above the sharded one (1/dp), so only ZeRO fits
    budget = (1 / spec.dp + 0.25 if spec.zero else 4.0) * state
    cluster = Cluster(hosts=1, devices_per_host=spec.dp, dtype_bytes=8, optimizer_bytes=16,
                      device_memory_gb=budget / 1e9)
    return plan(model, x, cluster, Constraints(dp=spec.dp, tp=1, pp=1, zero=spec.zero))


def _measure(spec: MemorySpec, p: Plan, device: torch.device) -> dict[str, Any]:
    from hexagram.parallel.apply import parallelize

    model, x, y = _build(spec)
    pm = parallelize(model, p)
    del model
    opt = torch.optim.Adam(pm.parameters(), lr=1e-3)
    x, y = x.to(device), y.to(device)

    def step() -> None:
        pm.train_step(x, y)
        opt.step()

    step()  # warm-up: Adam's state exists from here on
    opt.zero_grad(set_to_none=True)
    at_start = state_bytes(pm.module, opt)
    peaks = []
    for i in range(spec.steps):
        if i:  # each step starts as the first did: gradients freed
            opt.zero_grad(set_to_none=True)
        peaks.append(at_start["total"] + step_peak_bytes(step, device))
    zero = sorted(k for k, v in p.stages[0].shardings.items() if v.endswith("+zero"))
    # The median step: how many gathered parameters and reduce-scatter buffers are alive
    # at once depends on when the other ranks' collectives complete (four ranks on two
    # cores in the tests), so one step's peak moves by ~10 % between runs; every step's
    # peak is returned too.
    return {"zero_modules": zero, "state_at_start": at_start,
            "state_after_step": state_bytes(pm.module, opt),
            "peak_bytes": int(statistics.median(peaks)), "step_peaks": peaks,
            "predicted_bytes": p.memory_bytes}


def memory_worker(spec: MemorySpec, plans: list[Plan]) -> list[dict[str, Any]]:
    """On every rank, for each plan (from :func:`memory_plan`): apply it to a fresh model,
    one warm-up step with Adam, then one measured step; one row of bytes per plan."""
    from hexagram import runtime as hx  # init() only: the runtime, not the package root

    rt = hx.init()
    return [{"rank": rt.rank, **_measure(spec, p, rt.device)} for p in plans]
