"""Bad input and faults: dead and silent peers, mismatched models, missing init, bad config."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hexagram.launch import run_local


def _mlp(hidden: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 2))


def _peer_failure_worker(mode: str, marks: str) -> str:
    import hexagram as hx

    rt = hx.init(timeout=8)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = hx.DistributedDataParallel(model, optimizers=[opt])
    start = time.monotonic()
    for step in range(50):
        if rt.rank == 1 and step == 3:
            if mode == "die":
                os._exit(17)  # killed mid-training: its sockets close
            # alive but silent: only a timeout can tell. It stays silent until both peers
            # have raised (they mark it), at most 30 s: past their 8 s timeout, and the run
            # ends as soon as they did, well before its deadline
            until = time.monotonic() + 30
            while time.monotonic() < until and len(os.listdir(marks)) < 2:
                time.sleep(0.05)
            return "silent"
        try:
            ddp(torch.randn(4, 8)).sum().backward()
        except hx.CommError as exc:
            message = f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}"
            open(os.path.join(marks, f"raised{rt.rank}"), "w").close()
            return message
        opt.step()
        opt.zero_grad()
    return "no error"


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_peer_failure_raises_instead_of_hanging(mode: str, tmp_path: Path) -> None:
    results = run_local(_peer_failure_worker, 3, args=(mode, str(tmp_path)), timeout=60,
                        allow_failures=True)
    for rank in (0, 2):
        message = results[rank]
        assert isinstance(message, str) and message.startswith(("CommError", "CommTimeoutError"))
        assert "allreduce" in message and f"rank {rank} of 3" in message
        seconds = float(message.split(" after ")[1].split("s:")[0])
        assert seconds < 8 + 15  # within the configured timeout (plus start-up slack)
        if mode == "hang":
            assert message.startswith("CommTimeoutError")
    if mode == "hang":
        assert results[1] == "silent"  # it stayed silent past the peers' timeout
        assert len(list(tmp_path.iterdir())) == 2  # ... until both peers had raised


def _mismatch_worker() -> str:
    import hexagram as hx

    rt = hx.init(timeout=30)
    model = _mlp(hidden=16 if rt.rank != 2 else 17)
    try:
        hx.DistributedDataParallel(model)
    except hx.ModelMismatchError as exc:
        return str(exc)
    return "no error"


def test_mismatched_models_fail_on_every_rank_naming_the_parameter() -> None:
    for message in run_local(_mismatch_worker, 3, timeout=60):
        assert "rank 2" in message and "0.weight" in message and "[17, 8]" in message


def _no_init_worker() -> str:
    import hexagram as hx

    try:
        hx.DistributedDataParallel(_mlp())
    except hx.NotInitializedError as exc:
        return str(exc)
    return "no error"


def test_use_without_init_says_what_to_do() -> None:
    (message,) = run_local(_no_init_worker, 1, timeout=60)
    assert "hexagram.init()" in message and "torchrun" in message


def _single_process_worker() -> dict[str, object]:
    import hexagram as hx

    hx.init()
    out: dict[str, object] = {}
    errors: list[str] = []
    for bad in (lambda: hx.algorithms.get("allreducee"),
                lambda: hx.algorithms.get("allreduce", hierarchicl=True),
                lambda: hx.DistributedDataParallel(_mlp(), bucket_size_mb=-1)):
        try:
            bad()
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ddp = hx.DistributedDataParallel(model)
    out["keys"] = sorted(ddp.state_dict())
    ddp(torch.randn(5, 3)).sum().backward()
    out["grad"] = model[0].weight.grad is not None
    return out


def test_world_size_one_state_dict_and_bad_config() -> None:
    (out,) = run_local(_single_process_worker, 1, timeout=60)
    unknown, field, bucket = out["errors"]
    assert "'allreducee' is not registered" in unknown and "allreduce" in \
        unknown.split("valid are")[1] and "did you mean 'allreduce'?" in unknown
    assert "hierarchicl" in field and "hierarchical" in field
    assert "bucket_size_mb" in bucket
    assert out["keys"] == sorted("module." + k for k in [  # PyTorch DDP's keys
        "0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
        "1.num_batches_tracked"])
    assert out["grad"] is True


class _Odd(nn.Module):
    """Mixed dtypes, a non-contiguous parameter, and a forward order unlike registration."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(6, 2)  # registered first, used last
        self.t = nn.Parameter(torch.randn(6, 5).t())  # non-contiguous (5, 6) view
        self.wide = nn.Linear(6, 6).double()
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x @ self.t)  # (N, 5) @ (5, 6)
        h = self.wide(h.double()).float()
        return self.late(torch.relu(h))


def _odd_worker() -> dict[str, object]:
    import hexagram as hx

    rt = hx.init()
    torch.manual_seed(rt.rank)  # differs per rank: wrapping must broadcast rank 0's
    model = _Odd()
    ddp = hx.DistributedDataParallel(model, bucket_size_mb=0)
    first = [b.names for b in ddp.buckets]
    gen = torch.Generator().manual_seed(rt.rank)
    xs = [torch.randn(4, 5, generator=gen) for _ in range(2)]
    grads = []
    for x in xs:
        model.zero_grad()
        ddp(x).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    return {"first": first, "after": [b.names for b in ddp.buckets], "xs": xs,
            "grads": grads, "params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "t_contiguous": model.t.is_contiguous()}


def test_mixed_dtypes_noncontiguous_buffers_and_ready_order() -> None:
    results = run_local(_odd_worker, 2, timeout=90)
    r0, r1 = results
    assert r0["t_contiguous"] is False
    assert r0["first"][0] == ["norm.bias"]  # reverse registration order at first...
    assert r0["first"][-1] == ["t"]  # own parameters come first in registration order
    assert r0["after"][0][0].startswith("late.")  # late's gradients are ready first
    assert r0["after"][-1] == ["t"]
    assert r0["after"] == r1["after"]  # ...then the order gradients became ready, same everywhere
    for key, value in r0["params"].items():  # parameters start as rank 0's everywhere
        assert torch.equal(value, r1["params"][key]), key
    # Reference: one process, rank 0's initial model, gradient of the mean over both shards.
    torch.manual_seed(0)
    ref = _Odd()
    for step in range(2):
        ref.zero_grad()
        losses = []
        for rank in range(2):
            losses.append(ref(results[rank]["xs"][step]).sum())
        (sum(losses) / 2).backward()
        for n, p in ref.named_parameters():
            got = r0["grads"][step][n]
            assert got.dtype == p.dtype
            assert p.grad is not None and torch.allclose(got, p.grad, atol=1e-5), (step, n)
