"""Summing payloads in code space (compress.combine) equals decoding and adding them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import hexagram.compress as hc
from hexagram.compress.combine import sum_payloads

SIZES = [1, 7, 9, 1000, 1_100_001]  # 1_100_001: several blocks, a partial last byte


def _payloads(name: str, ranks: int, n: int, dtype: torch.dtype) -> list[hc.Payload]:
    c = hc.get(name)
    out = []
    for r in range(ranks):
        x = torch.randn(n, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        x[:: 5] = 0.0  # zeros: the sign formats' "non-negative" bit
        out.append(c.compress(x.to(dtype), torch.Generator().manual_seed(100 + r)))
    return out


def _sequential(c: hc.Compressor, payloads: list[hc.Payload], out: torch.Tensor,
                finish: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    for i, p in enumerate(payloads):
        c.decompress_into(p, out, add=i > 0)
    return finish(out)


@pytest.mark.parametrize(("name", "max_ranks"), [("sign", 8), ("efsign", 8), ("onebit", 8),
                                                 ("terngrad", 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_equals_decoding_and_adding_in_rank_order(name: str, max_ranks: int,
                                                  dtype: torch.dtype) -> None:
    c = hc.get(name)
    for ranks in range(1, max_ranks + 1):
        for n in SIZES if ranks in (1, 3, max_ranks) else SIZES[:4]:
            ps = _payloads(name, ranks, n, dtype)
            for finish in (lambda t, p=ranks: t.div_(p), lambda t: t.sign_()):
                want = _sequential(c, ps, torch.empty(n, dtype=dtype), finish)
                got = sum_payloads(c, ps, torch.full((n,), float("nan"), dtype=dtype), finish)
                assert got is not None and torch.equal(got, want), (ranks, n)


@pytest.mark.parametrize(("name", "ranks"), [("sign", 9), ("terngrad", 5), ("qsgd", 2),
                                             ("topk", 2), ("minmax8", 2), ("fp16", 2)])
def test_declines_formats_and_world_sizes_it_cannot_index(name: str, ranks: int) -> None:
    c = hc.get(name)
    ps = _payloads(name, ranks, 100, torch.float32)
    out = torch.zeros(100)
    assert sum_payloads(c, ps, out, lambda t: t) is None
    assert bool((out == 0).all())  # untouched
