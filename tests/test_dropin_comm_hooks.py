"""``register_comm_hook`` with PyTorch's built-in hooks: a DDP script registering them runs
with only its import changed, sends the same bytes per step (PowerSGD: and the engine's
8-byte non-finite agreement, see :data:`FLAG`) and ends with the same (fp16, bf16: within
rounding) or close (PowerSGD) parameters; other hooks are refused with one line; a second
registration raises PyTorch's error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dropin import run_both, single_rank
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from hexagram.engine.comm_hooks import ONCE, algorithm_for
from hexagram.errors import ConfigError
from hexagram.launch import run_local

NUMEL = 16 * 16 + 16 + 8 * 16 + 8  # the script's model
#: bytes a step that Hexagram's PowerSGD adds to PyTorch's hook on 2 ranks: one int64 summed
#: over the ranks, so that every rank raises, skips or lets its GradScaler skip the same
#: step when some rank's gradient holds NaN/Inf (its factors cannot carry it: error
#: feedback keeps what they miss). The 16-bit hooks need none: their sum carries it.
FLAG = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return run_both(tmp_path_factory.mktemp("hooks"), "hooks")


def _initial() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [p.detach() for p in nn.Sequential(nn.Linear(16, 16), nn.Tanh(),
                                              nn.Linear(16, 8)).parameters()]


def _compare(runs: dict[str, list[dict[str, Any]]], case: str, atol: float,
             relative: float = 0.1, flag: int = 0) -> None:
    for rank in (0, 1):
        ref, got = runs["torch"][rank][case], runs["hexagram"][rank][case]
        # the same bytes, step by step
        assert got["sent"] == [s + flag for s in ref["sent"]], (case, rank)
        for p0, a, b in zip(_initial(), ref["params"], got["params"]):
            torch.testing.assert_close(b, a, rtol=0, atol=atol, msg=case)
            moved, gap = (a - p0).abs().max(), (b - a).abs().max()
            assert gap <= relative * moved, (case, float(gap), float(moved))  # it trained


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["fp16", "bf16"])
def test_16_bit_compress_hooks_match_pytorch(runs: dict[str, Any], case: str) -> None:
    _compare(runs, case, atol=1e-6)
    assert runs["hexagram"][0][case]["sent"] == [2 * NUMEL] * 4  # one 16-bit allreduce


@pytest.mark.timeout(240)
def test_powersgd_hook_warms_up_then_sends_factors_as_pytorch(runs: dict[str, Any]) -> None:
    _compare(runs, "powersgd", atol=1e-4, flag=FLAG)  # rank 2 captures these gradients
    sent = runs["hexagram"][0]["powersgd"]["sent"]
    factors = 4 * (2 * (16 + 16) + 2 * (8 + 16) + 16 + 8)  # P, Q of each weight; biases
    # start_powerSGD_iter=2: allreduce first
    assert sent == [4 * NUMEL + FLAG] * 2 + [factors + FLAG] * 3


@pytest.mark.timeout(240)
def test_fp16_wrapper_around_powersgd_halves_its_bytes(runs: dict[str, Any]) -> None:
    # fp16 factors on the wire round differently: the first compressed step's random Q
    # differs (PyTorch's RNG, Hexagram's seeded per parameter name), and with Hexagram's
    # the first layer's P = M Q has a condition number near 700, so fp16's rounding of P
    # blurs its second direction (error feedback then carries the difference on)
    _compare(runs, "fp16+powersgd", atol=2e-2, relative=0.35, flag=FLAG)
    half = runs["hexagram"][0]["fp16+powersgd"]["sent"]
    assert half == [(s - FLAG) // 2 + FLAG for s in runs["hexagram"][0]["powersgd"]["sent"]]
    full = runs["torch"][0]["powersgd"]["params"]  # float32 factors: exact here
    for a, b in zip(full, runs["hexagram"][0]["fp16+powersgd"]["params"]):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-2)


SIDE, STEPS = 32, 12


class _Probe(nn.Module):
    """loss = <w, x>: the gradient of ``w`` is ``x``, whatever ``w`` holds."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(SIDE, SIDE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def _small_gradient() -> torch.Tensor:
    """(SIDE, SIDE), singular values 1e-3 * 10 ** (-i / 2): a small gradient, whose
    squared singular values are fp16 subnormals."""
    gen = torch.Generator().manual_seed(3)
    u = torch.linalg.qr(torch.randn(SIDE, SIDE, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(SIDE, SIDE, generator=gen))[0]
    return 1e-3 * (u * torch.tensor([10 ** (-i / 2) for i in range(SIDE)])) @ v.t()


def _reduced(kind: str, half: bool) -> list[torch.Tensor]:
    """The gradient the optimizer gets at each of STEPS steps of rank-2 PowerSGD (2 steps
    of allreduce first), under PyTorch DDP's hook or Hexagram, in fp16 or not."""
    import hexagram as hx

    net = _Probe()
    model: Any
    if kind == "torch":
        model = nn.parallel.DistributedDataParallel(net)
        hook = default.fp16_compress_wrapper(powersgd.powerSGD_hook) if half \
            else powersgd.powerSGD_hook
        model.register_comm_hook(powersgd.PowerSGDState(
            None, matrix_approximation_rank=2, start_powerSGD_iter=2), hook)
    else:
        model = hx.DistributedDataParallel(net, algorithm=hx.algorithms.get(
            "powersgd", rank=2, start_iter=2, cast="fp16" if half else None))
    out = []
    for _ in range(STEPS):
        model(_small_gradient()).backward()
        assert net.w.grad is not None
        out.append(net.w.grad.clone())
        net.w.grad = None
    if kind == "hexagram":
        model.close()
    return out


def _fp16_gaps() -> dict[str, list[float]]:
    import hexagram as hx

    hx.init()
    return {kind: [float((a - b).abs().max()) for a, b in
                   zip(_reduced(kind, True), _reduced(kind, False))]
            for kind in ("torch", "hexagram")}


@pytest.mark.timeout(120)
def test_fp16_powersgd_of_a_small_gradient_is_as_close_to_fp32_as_pytorch_s() -> None:
    # P = M Q from the warm start Q = M^T P of the last step is of the order of M's
    # singular values squared (1e-6 here: fp16 subnormals, a few bits); orthonormalizing
    # Q first, as PyTorch's hook does, keeps P of the order of M. Without it Hexagram's
    # fp16 factors missed the fp32 result by up to 1.6e-4 (a sixth of the largest singular
    # value), 100x PyTorch's miss; with it, no more than PyTorch's (it computes in fp32)
    gaps = run_local(_fp16_gaps, 1, timeout=100)[0]
    torch_worst = max(gaps["torch"])
    assert 0 < torch_worst < 1e-5, gaps  # a few fp16 roundings of values near 1e-3
    for step, gap in enumerate(gaps["hexagram"]):
        assert gap <= max(torch_worst, 2 * gaps["torch"][step]), (step, gaps)


def test_hooks_map_to_algorithms() -> None:
    state = powersgd.PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=7,
                                   min_compression_rate=4, use_error_feedback=False,
                                   warm_start=False)
    algo = algorithm_for(state, powersgd.powerSGD_hook, world_size=2)
    c = algo.config
    assert (algo.name, c.rank, c.start_iter, c.min_compression_rate) == ("powersgd", 3, 7, 4.0)
    assert (c.error_feedback, c.warm_start, c.granularity) == (False, False, "layer")
    batched = algorithm_for(state, powersgd.batched_powerSGD_hook, world_size=2)
    assert batched.config.granularity == "bucket"
    bf16 = algorithm_for(None, default.bf16_compress_hook, world_size=2)
    assert (bf16.name, bf16.config.wire) == ("fp16", "bf16")
    cast = algorithm_for(state, default.bf16_compress_wrapper(powersgd.powerSGD_hook), 2)
    assert (cast.name, cast.inner.name, cast.dtype) == ("cast", "powersgd", torch.bfloat16)
    assert algorithm_for(None, default.allreduce_hook, world_size=2).name == "allreduce"
    with pytest.raises(ConfigError, match="PowerSGDState"):
        algorithm_for(None, powersgd.powerSGD_hook, world_size=2)


@pytest.mark.timeout(120)
def test_other_hooks_and_a_second_registration_are_refused() -> None:
    out = single_rank()
    for name, error in out["refused"].items():
        assert error.startswith("ConfigError: ") and "\n" not in error, (name, error)
    for name in ("own", "noop"):
        assert "algorithm=" in out["refused"][name], out["refused"][name]
    assert "noop_hook" in out["refused"]["noop"]
    assert "min_compression_rate=0.5" in out["refused"]["rate"]
    assert "16-bit already" in out["refused"]["fp16 of fp16"]
    assert (out["first"], out["algorithm"]) == ("", "fp16")  # refusals left no trace
    assert out["twice"] == f"RuntimeError: {ONCE}"  # PyTorch's error, word for word
    assert out["chosen"].startswith("ConfigError: ") and "algorithm='topk'" in out["chosen"]
