"""Mixed precision: an overflow on one rank reaches every rank's GradScaler.

Every registered algorithm trains 3 steps of fp16 autocast (on the CPU) with a
``torch.amp.GradScaler`` on 2 gloo ranks; at step 1 only rank 1's loss is multiplied by
Inf. Every rank must skip that optimizer step (no NonFiniteGradientError, no zero gradient
applied), lower its scale together with the other, take the other steps, and end with
finite weights; the algorithms with step hooks (local SGD, DiLoCo, decentralized, QAdam's
and robust's momentum takeover) stay in step. The async averager's ranks are independent
by design (time-driven rounds, no step hooks): only the overflowing rank skips and lowers
its scale there. ``robust`` treats the overflowing rank as Byzantine instead: its row is
dropped, and every rank steps on the others' aggregate with its scale unchanged (the same
decision on every rank, and the honest ranks lose no step).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hexagram.launch import run_local

STEPS, BAD_STEP, BAD_RANK = 3, 1, 1


def _amp_run(name: str, hooked: bool = True) -> dict[str, Any]:
    """``hooked=False``: the wrapper is given no optimizer (the engine reads its check at
    the end of backward, where an overflow under autocast is left to the scaler)."""
    from _every_algorithm import config_for, optimizer_for, small_model

    import hexagram as hx

    rt = hx.get_runtime()
    net = small_model()
    opt = optimizer_for(name, net.parameters())
    ddp = hx.DistributedDataParallel(net, optimizers=[opt] if hooked else None,
                                     algorithm=hx.algorithms.get(name, **config_for(name)),
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
    out = {name: _amp_run(name) for name in names}
    out["topk, no optimizers"] = _amp_run("topk", hooked=False)
    return out


@pytest.fixture(scope="module")
def amp_results() -> list[dict[str, Any]]:
    import hexagram as hx

    return run_local(_worker, 2, args=(hx.algorithms.names(),), timeout=180)


def _names() -> list[str]:
    import hexagram as hx

    return hx.algorithms.names()


@pytest.mark.parametrize("name", [*_names(), "topk, no optimizers"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(
        name: str, amp_results: list[dict[str, Any]]) -> None:
    runs = [r[name] for r in amp_results]
    for rank, run in enumerate(runs):
        assert run["error"] is None, f"rank {rank}: {run['error']}"
        assert run["finite"], f"rank {rank}: non-finite weights"
        scales = run["scales"]
        if name == "robust":  # the overflowing row dropped: every rank steps on
            assert BAD_STEP in run["taken"] and scales[BAD_STEP] == scales[BAD_STEP - 1], run
        elif name != "async" or rank == BAD_RANK:
            assert BAD_STEP not in run["taken"], f"rank {rank} stepped on Inf: {run}"
            assert scales[BAD_STEP] == scales[BAD_STEP - 1] / 2, run  # lowered (backoff 0.5)
        assert len(run["taken"]) >= STEPS - 1, run
    if name != "async":
        assert runs[0]["scales"] == runs[1]["scales"] and runs[0]["taken"] == runs[1]["taken"]


class _Scaled(nn.Module):
    """A linear layer times a float32 parameter: under fp16 autocast the product runs in
    float32, so ``scale``'s gradient can pass fp16's range while staying finite."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def _fp16_wire_overflow() -> dict[str, Any]:
    """The fp16 algorithm under autocast with GradScaler's default scale (2**16): at step 1
    rank 1's ``scale`` gradient passes fp16's range on the wire (finite in float32)."""
    import hexagram as hx

    rt = hx.get_runtime()
    torch.manual_seed(0)
    net = _Scaled()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    ddp = hx.DistributedDataParallel(net, optimizers=[opt], algorithm="fp16")
    scaler = torch.amp.GradScaler("cpu")
    taken: list[int] = []
    opt.register_step_post_hook(lambda *_: taken.append(step))
    out: dict[str, Any] = {"scales": [], "error": None}
    try:
        for step in range(STEPS):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ddp(x).float().square().mean()
            if step == BAD_STEP and rt.rank == BAD_RANK:
                loss = loss * 100.0  # finite; x 2**16 passes 65504 in scale's gradient
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            out["scales"].append(scaler.get_scale())
    except Exception as exc:  # reported, asserted on below
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["taken"] = taken
    ddp.close()
    return out


def _wire_worker() -> dict[str, Any]:
    import hexagram as hx

    hx.init()
    return _fp16_wire_overflow()


def test_an_fp16_wire_overflow_reaches_every_scaler_and_stays_in_its_step() -> None:
    ranks = run_local(_wire_worker, 2, timeout=120)
    for rank in ranks:  # not an error, then or later: the scalers skip step 1 together
        assert rank["error"] is None, rank["error"]
        assert rank["taken"] == [s for s in range(STEPS) if s != BAD_STEP], rank
    assert ranks[0]["scales"] == ranks[1]["scales"]
    assert ranks[0]["scales"][BAD_STEP] < ranks[0]["scales"][0]
