"""Mixed precision: an overflow on one rank reaches every rank's GradScaler.

Every registered algorithm trains 3 steps of fp16 autocast (on the CPU) with a
``torch.amp.GradScaler`` on 2 gloo ranks; at step 1 only rank 1's loss is multiplied by
Inf. Every rank must skip that optimizer step (no NonFiniteGradientError, no zero gradient
applied), lower its scale together with the other, take the other steps, and end with
finite weights; the algorithms with step hooks (local SGD, DiLoCo, decentralized, QAdam's
and robust's momentum takeover) stay in step. The async averager's ranks are independent
by design (time-driven rounds, no step hooks): only the overflowing rank skips and lowers
its scale there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hexagram.launch import run_local

STEPS, BAD_STEP, BAD_RANK = 3, 1, 1


def _amp_run(name: str) -> dict[str, Any]:
    from _every_algorithm import config_for, optimizer_for, small_model

    import hexagram as hx

    rt = hx.get_runtime()
    net = small_model()
    opt = optimizer_for(name, net.parameters())
    ddp = hx.DistributedDataParallel(net, [opt], hx.algorithms.get(name, **config_for(name)),
                                     bucket_size_mb=0.001)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    taken: list[int] = []
    opt.register_step_post_hook(lambda *_: taken.append(step))
    gen = torch.Generator().manual_seed(100 + rt.rank)
    out: dict[str, Any] = {"scales": [], "error": None}
    try:
        for step in range(STEPS):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(ddp(x).float(), y)
            if step == BAD_STEP and rt.rank == BAD_RANK:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            out["scales"].append(scaler.get_scale())
        ddp.synchronize()
    except Exception as exc:  # reported, asserted on below
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["taken"] = taken
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    ddp.close()
    return out


def _worker(names: list[str]) -> dict[str, Any]:
    import hexagram as hx

    hx.init()
    return {name: _amp_run(name) for name in names}


@pytest.fixture(scope="module")
def amp_results() -> list[dict[str, Any]]:
    import hexagram as hx

    return run_local(_worker, 2, args=(hx.algorithms.names(),), timeout=180)


def _names() -> list[str]:
    import hexagram as hx

    return hx.algorithms.names()


@pytest.mark.parametrize("name", _names())
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(
        name: str, amp_results: list[dict[str, Any]]) -> None:
    runs = [r[name] for r in amp_results]
    for rank, run in enumerate(runs):
        assert run["error"] is None, f"rank {rank}: {run['error']}"
        assert run["finite"], f"rank {rank}: non-finite weights"
        scales = run["scales"]
        if name != "async" or rank == BAD_RANK:
            assert BAD_STEP not in run["taken"], f"rank {rank} stepped on Inf: {run}"
            assert scales[BAD_STEP] == scales[BAD_STEP - 1] / 2, run  # lowered (backoff 0.5)
        assert len(run["taken"]) >= STEPS - 1, run
    if name != "async":
        assert runs[0]["scales"] == runs[1]["scales"] and runs[0]["taken"] == runs[1]["taken"]
