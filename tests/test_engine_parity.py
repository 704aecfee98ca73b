"""Hexagram's allreduce engine against PyTorch DDP: same seeds, same data, same parameters.

One spawned job per world size runs every configuration (optimizer x no_sync x bucket size)
to amortise process start-up; each configuration wraps a fresh model pair.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from hexagram.launch import run_local

STEPS = 20
BUCKETS_MB = (0.0, 0.002, 25.0)  # one tensor per bucket, a few tensors per bucket, one bucket


class Net(nn.Module):
    """Small MLP with a frozen layer, so requires_grad=False parameters are exercised."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(12, 24)
        self.frozen = nn.Linear(24, 24)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.frozen(self.embed(x)))


def _make(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, accumulate: int) -> None:
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(STEPS):
        for micro in range(accumulate):
            x = torch.randn(6, 12, generator=gen)
            y = torch.randint(0, 5, (6,), generator=gen)
            last = micro == accumulate - 1
            ctx = model.no_sync() if not last else _null()  # type: ignore[operator]
            with ctx:
                nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _parity_worker() -> dict[str, float]:
    import hexagram as hx

    rt = hx.init()
    diffs: dict[str, float] = {}
    configs = [(*c, True) for c in itertools.product(("sgd", "adam"), (1, 3), BUCKETS_MB)]
    configs += [("sgd", accumulate, bucket_mb, False)  # gradients of their own, as DDP's
                for accumulate, bucket_mb in itertools.product((1, 3), BUCKETS_MB)]
    for opt_name, accumulate, bucket_mb, as_view in configs:
        # Different seeds per rank: wrapping must broadcast rank 0's parameters.
        ours, ref = _make(rt.rank), _make(rt.rank)
        ref.load_state_dict(_make(0).state_dict())
        o1 = _optimizer(opt_name, [p for p in ours.parameters() if p.requires_grad])
        o2 = _optimizer(opt_name, [p for p in ref.parameters() if p.requires_grad])
        wrapped = hx.DistributedDataParallel(ours, optimizers=[o1],
                                             algorithm="allreduce", bucket_size_mb=bucket_mb,
                                             gradient_as_bucket_view=as_view)
        baseline = TorchDDP(ref, bucket_cap_mb=max(bucket_mb, 0.001))
        _train(wrapped, o1, rt.rank, accumulate)
        _train(baseline, o2, rt.rank, accumulate)
        key = f"{opt_name}/accumulate={accumulate}/bucket={bucket_mb}MB/view={as_view}"
        diffs[key] = max((a - b).abs().max().item()
                         for a, b in zip(ours.parameters(), ref.parameters()))
        wrapped.close()
    return diffs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parameters_match_pytorch_ddp(world_size: int) -> None:
    results = run_local(_parity_worker, world_size, timeout=240)
    for rank, diffs in enumerate(results):
        assert len(diffs) == 18
        for key, diff in diffs.items():
            assert diff <= 1e-6, f"rank {rank} {key}: max |hexagram - DDP| = {diff}"


def _views_worker(as_view: bool) -> list[bool]:
    import hexagram as hx

    hx.init()
    torch.manual_seed(0)
    model = hx.DistributedDataParallel(_make(0), gradient_as_bucket_view=as_view)
    x = torch.randn(4, 12)
    out = []
    for _ in range(2):  # the second backward accumulates into the views themselves
        model(x).sum().backward()
        storages = {b.flat.untyped_storage().data_ptr() for b in model.buckets}
        out += [p.grad.untyped_storage().data_ptr() in storages
                for p in model.module.parameters() if p.requires_grad]
    return out


@pytest.mark.parametrize("as_view", [True, False])
def test_gradients_are_bucket_views_only_when_asked(as_view: bool) -> None:
    for in_bucket in run_local(_views_worker, 2, args=(as_view,), timeout=120):
        assert in_bucket == [as_view] * len(in_bucket)


def _unused_worker() -> tuple[float, list[str], list[bool]]:
    import hexagram as hx

    rt = hx.init()

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.never = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            return self.a(x) + (self.b(x) if use_b else 0)

    torch.manual_seed(0)
    ours, ref = Branchy(), Branchy()
    ref.load_state_dict(ours.state_dict())
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref))
    wrapped = hx.DistributedDataParallel(ours, optimizers=[o1], find_unused_parameters=True)
    baseline = TorchDDP(ref, find_unused_parameters=True)
    gen = torch.Generator().manual_seed(rt.rank)
    for step in range(6):
        x = torch.randn(5, 4, generator=gen)
        use_b = (step + rt.rank) % 2 == 0  # b is used on some ranks only in some steps
        for m, o in ((wrapped, o1), (baseline, o2)):
            m(x, use_b).sum().backward()
            o.step()
            o.zero_grad(set_to_none=False)
    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters()))
    # Without the flag, a step that leaves a parameter unused is an error that names it.
    strict = hx.DistributedDataParallel(Branchy(), find_unused_parameters=False)
    errors: list[str] = []
    try:
        strict(torch.randn(2, 4), True).sum().backward()
    except RuntimeError as exc:
        errors.append(str(exc))
    grads_none = [p.grad is None for p in ours.never.parameters()]
    return diff, errors, grads_none


def test_unused_parameters_match_ddp_and_strict_mode_names_them() -> None:
    for diff, errors, never_none in run_local(_unused_worker, 2, timeout=120):
        assert diff <= 1e-6
        assert errors and "never.weight" in errors[0] and "find_unused_parameters" in errors[0]
        assert never_none == [True, True]  # globally unused: .grad stays None, as in DDP
