"""The numpy CPU kernels of the compressors give the same bits as their torch paths."""

from __future__ import annotations

import pytest
import torch

from hexagram.compress.feedback import ErrorFeedback, subtract_pairs
from hexagram.compress.packing import pack_codes
from hexagram.compress.quantize import truncate_to
from hexagram.compress.sign_bits import _signs_numpy, encode_signs
from hexagram.compress.sparsify import TopKCompressor, TopKConfig


def _awkward(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal values with signed zeros, tiny and huge entries sprinkled in."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    x[::7] = 0.0
    x[3::11] = -0.0
    x[5::13] = torch.finfo(dtype).tiny / 4  # subnormal
    x[6::17] = -torch.finfo(dtype).max
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,block", [(1, 8), (13, 8), (64, 16), (1001, 40)])
def test_numpy_sign_bits_match_torch(dtype: torch.dtype, n: int, block: int) -> None:
    x = _awkward(n, dtype)
    counts = torch.zeros(-(-n // block), dtype=torch.int64)
    seen: list[tuple[int, int]] = []
    packed = _signs_numpy(x, block, lambda a, b: seen.append((a, b)), counts)
    expected = pack_codes((x >= 0).to(torch.uint8), 1)  # -0.0 >= 0: bit 1
    assert torch.equal(packed, expected)
    assert seen == [(s, min(n, s + block)) for s in range(0, n, block)]
    assert [int(c) for c in counts] == [int((x[s:s + block] >= 0).sum())
                                        for s in range(0, n, block)]


def test_encode_signs_stats_match_the_torch_path() -> None:
    x = _awkward(5000, torch.float32).clamp(-10, 10)
    packed, stats = encode_signs(x, "test")
    assert torch.equal(packed, pack_codes((x >= 0).to(torch.uint8), 1))
    assert float(stats[2]) == int((x >= 0).sum())
    assert float(stats[1]) == pytest.approx(float(x.double().sum()), rel=1e-5)
    assert float(stats[0]) == pytest.approx(float(x.double().abs().sum()), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_truncate_to_matches_the_int32_route(dtype: torch.dtype) -> None:
    values = torch.rand(4099, generator=torch.Generator().manual_seed(1), dtype=dtype) * 256
    values[:4] = torch.tensor([0.0, 0.999, 255.999, 127.5], dtype=dtype)
    codes = torch.empty(values.numel(), dtype=torch.uint8)
    truncate_to(codes, values, torch.empty(values.numel(), dtype=torch.int32))
    assert torch.equal(codes, values.to(torch.int32).to(torch.uint8))
    assert codes[:4].tolist() == [0, 0, 255, 127]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_residual_matches_decode_then_subtract(dtype: torch.dtype) -> None:
    x = _awkward(3001, dtype).clamp(-1e3, 1e3)
    x[:40] = -0.0  # k larger than the nonzeros of this part: -0.0 entries get sent
    for k in (1, 37, 3001):
        comp = TopKCompressor(TopKConfig(k=k))
        payload = comp.compress(x)
        expected = x - comp.decompress(payload)
        got = subtract_pairs(payload, x, torch.empty_like(x))
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # signed zeros
        ef = ErrorFeedback(comp)
        ef.update_from("w", x, payload)
        residual = ef.residual("w")
        assert residual is not None
        assert torch.equal(residual.view(torch.uint8), expected.view(torch.uint8))


def _merge_reference(va: torch.Tensor, ia: torch.Tensor, vb: torch.Tensor, ib: torch.Tensor,
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gTop-k's merge as it was: ``unique`` of both index lists, ``index_add_``, top-k."""
    uniq, inverse = torch.unique(torch.cat([ia, ib]), return_inverse=True)
    summed = torch.zeros(uniq.numel(), dtype=va.dtype).index_add_(0, inverse,
                                                                  torch.cat([va, vb]))
    keep = torch.topk(summed.abs(), min(k, uniq.numel()), sorted=False).indices
    order = torch.argsort(uniq[keep])
    return summed[keep][order], uniq[keep][order]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("presorted", [False, True])
def test_gtopk_merge_matches_unique_index_add(dtype: torch.dtype, presorted: bool) -> None:
    """Sorted (numpy) merge = the unique/index_add_ merge, bit for bit (signed zeros and
    exact cancellations included), with the output in increasing index order."""
    from hexagram.comm.gtopk import _sort_pairs, merge_topk

    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        numel = int(torch.randint(1, 500, (1,), generator=g))
        ka, kb = (int(torch.randint(0, numel + 1, (1,), generator=g)) for _ in range(2))
        ia, ib = torch.randperm(numel, generator=g)[:ka], torch.randperm(numel, generator=g)[:kb]
        va = torch.randint(-3, 3, (ka,), generator=g).to(dtype)
        va[va == 0] = -0.0
        vb = -va[:kb].clone() if kb <= ka and trial % 2 else torch.randn(kb, generator=g,
                                                                      dtype=dtype)
        ib = ia[:kb].clone() if kb <= ka and trial % 2 else ib
        k = int(torch.randint(1, numel + 2, (1,), generator=g))
        args = (va, ia, vb, ib)
        if presorted:
            args = (*_sort_pairs(va, ia)[:2], *_sort_pairs(vb, ib)[:2])
        v, i = merge_topk(*args, k)
        rv, ri = _merge_reference(va, ia, vb, ib, k)
        assert torch.equal(i, ri) and torch.equal(v.view(torch.uint8), rv.view(torch.uint8))
        assert bool((i[1:] > i[:-1]).all())


def test_gtopk_membership_matches_isin() -> None:
    from hexagram.comm.gtopk import _isin

    g = torch.Generator().manual_seed(4)
    for n in (0, 1, 7, 1000):
        test = torch.randperm(5000, generator=g)[:n]
        elements = torch.randperm(5000, generator=g)[:300]
        assert torch.equal(_isin(elements, test), torch.isin(elements, test))


def test_randomk_positions_match_the_int64_formula() -> None:
    """float64 strata = ``start + clamp((u * size).long(), max=size - 1)`` in int64."""
    from hexagram.compress.sparsify import RandomKCompressor

    g = torch.Generator().manual_seed(5)
    for n in (1, 2, 3, 97, 1000, 65_537, 999_983):
        for k in {1, max(1, n // 4), max(1, n // 3), n}:
            u = torch.rand(k, dtype=torch.float64, generator=g)
            u[: min(k, 2)] = 1.0 - 2.0**-53  # the largest u: the clamp must hold
            start, size = RandomKCompressor._strata(n, k, u.device)
            expect = start + (u * size).long().clamp_(max=size - 1)
            assert torch.equal(RandomKCompressor._positions(u, n), expect), (n, k)
