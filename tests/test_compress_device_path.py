"""The code CUDA takes, run on the CPU (``packing.CPU_FAST_PATHS = False``), against the CPU's.

The CPU keeps its numpy fast paths and the decisions that read a tensor (free there); the
device path reads nothing. Where both compute the same arithmetic the results must be equal
bit for bit; where the device path takes another (float64 sums, the exact min-max form,
torch's random bits) they must agree to the format's own error. Lookup tables are copied to
a device once, and blocks span the whole tensor off the CPU.
"""

from __future__ import annotations

import pytest
import torch

import hexagram.compress as hc
from hexagram.compress import packing

#: same arithmetic on both paths: equal bits (efsign and onebit per block of 256, the
#: algorithms' default; per tensor their sums are float64 on the device, see below)
EXACT = ["fp16", "bf16", "sign", "efsign", "onebit", "topk", "randomk", "threshold",
         "powersgd"]


def _x(n: int = 70_001) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    x[::97] = 0.0
    return x


def _roundtrip(name: str, x: torch.Tensor, **config: object) -> torch.Tensor:
    c = hc.get(name, **config)
    return c.decompress(c.compress(x))


@pytest.mark.parametrize("name", EXACT)
def test_device_path_gives_the_same_bits(name: str, device_path: None) -> None:
    kw = {"block": 256} if name in ("efsign", "onebit") else {}
    got = _roundtrip(name, _x(), **kw)
    packing.CPU_FAST_PATHS = True
    assert torch.equal(got, _roundtrip(name, _x(), **kw))


@pytest.mark.parametrize("name", ["efsign", "onebit"])
def test_device_per_tensor_sign_headers_sum_in_float64(name: str, device_path: None) -> None:
    """The CPU sums blocks in float32, then in float64; the device sums in float64 at once
    (no overflow to fall back from): the same values to float32's rounding."""
    got = _roundtrip(name, _x())
    packing.CPU_FAST_PATHS = True
    torch.testing.assert_close(got, _roundtrip(name, _x()), rtol=1e-6, atol=0)


def test_device_minmax8_within_one_code(device_path: None) -> None:
    x = _x() + 3.0  # chunks that do not straddle 0 as well
    got = _roundtrip("minmax8", x)
    packing.CPU_FAST_PATHS = True
    want = _roundtrip("minmax8", x)
    step = (x.max() - x.min()) / 255
    assert float((got - want).abs().max()) <= float(step)


@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_device_stochastic_quantizers_stay_unbiased_levels(name: str, device_path: None) -> None:
    x = _x(4096)
    mean = torch.stack([_roundtrip(name, x, seed=s) for s in range(200)]).mean(0)
    assert float((mean - x).abs().mean()) < 0.1 * float(x.abs().mean())


def test_device_headers_survive_extreme_magnitudes(device_path: None) -> None:
    x = _x(3000)
    for name in ("minmax8", "qsgd", "terngrad", "efsign", "onebit", "sign"):
        for scale in (2.0**100, 2.0**-100):
            kw = {"seed": 1} if name in ("qsgd", "terngrad") else {}
            y = _roundtrip(name, x * scale, **kw)
            assert bool(torch.isfinite(y).all()), (name, scale)


def test_nan_reaches_the_decoded_values_unchecked(device_path: None) -> None:
    """With the compressor's own check off (an algorithm checks once per step), NaN input
    must not decode to finite garbage for formats that carry a scale."""
    for name in ("minmax8", "qsgd", "terngrad", "efsign", "onebit", "topk", "fp16"):
        c = hc.get(name)
        c.checks_finite = False
        x = _x(5000)
        x[17] = float("nan")
        assert not bool(torch.isfinite(c.decompress(c.compress(x))).all()), name


def test_tables_are_copied_once_per_device_and_blocks_span_the_tensor() -> None:
    meta = torch.device("meta")
    assert packing.unpack_table(2, meta) is packing.unpack_table(2, meta)
    assert packing.unpack_table(2, meta).device == meta
    assert packing.unpack_table(2, "cpu") is packing.unpack_table(2)
    assert packing.block_size(torch.device("cuda")) == packing.ONE_PASS
    assert packing.block_size(torch.device("cpu")) == packing.block_size() == 16 * packing.BLOCK
