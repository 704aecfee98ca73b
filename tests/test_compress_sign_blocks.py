"""Block-wise scales of ``efsign`` and ``onebit`` (``block=B``): each block of ``B``
elements decodes with its own scale / reconstruction values, computed by hand here."""

from __future__ import annotations

import math

import pytest
import torch

import hexagram.compress as hc
from hexagram.compress.base import NonFiniteGradientError


def _reference(name: str, x: torch.Tensor, block: int) -> torch.Tensor:
    """Per block (the last one shorter), in float64: +-mean|x| (efsign), or the mean of the
    block's non-negative / negative entries (onebit)."""
    xd = x.double()
    out = torch.empty_like(xd)
    for start in range(0, x.numel(), block):
        b = xd[start:start + block]
        pos = b >= 0
        if name == "efsign":
            hi = b.abs().mean()
            lo = -hi
        else:
            hi = b[pos].mean() if pos.any() else b.new_zeros(())
            lo = b[~pos].mean() if (~pos).any() else b.new_zeros(())
        out[start:start + b.numel()] = torch.where(pos, hi, lo)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n", "block"), [(1, 1), (7, 1), (1000, 1), (1, 7), (7, 7),
                                          (1000, 7), (40_001, 7), (7, 512), (1000, 512),
                                          (40_001, 512)])
@pytest.mark.parametrize("name", ["efsign", "onebit"])
def test_blocks_decode_to_their_own_values(name: str, block: int, n: int,
                                           dtype: torch.dtype) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + block), dtype=dtype)
    x[::5] *= 30.0  # magnitudes that differ between blocks
    c = hc.get(name, block=block)
    payload = c.compress(x)
    groups = math.ceil(n / block)
    assert payload.nbytes == math.ceil(n / 8) + groups * (1 if name == "efsign" else 2) * \
        (4 if dtype == torch.float32 else 8)
    got = c.decompress(payload)
    torch.testing.assert_close(got.double(), _reference(name, x, block),
                               rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=1e-12)
    out = torch.ones(n, dtype=dtype)
    c.decompress_into(payload, out, add=True)
    torch.testing.assert_close(out, got + 1)
    if block == 1 and name == "onebit":  # one element per block: lossless
        assert torch.equal(got, x)


@pytest.mark.parametrize("name", ["efsign", "onebit"])
def test_blocks_refuse_nan(name: str) -> None:
    x = torch.ones(1000)
    x[600] = float("nan")
    with pytest.raises(NonFiniteGradientError):
        hc.get(name, block=64).compress(x)


def test_block_must_be_a_non_negative_integer() -> None:
    with pytest.raises(Exception, match="block"):
        hc.get("onebit", block=-1)
