"""Round trips of every compressor: shapes, dtypes, edge cases, per-compressor error bounds."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch

import hexagram.compress as hc

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(1,), (7,), (9,), (3, 5), (2, 3, 4), (5000,)]
BIG = (1_100_001,)  # more than one encoding block (packing.block_size()), float32 only


def _x(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """Half an ulp of each element in its dtype (the rounding of a final cast)."""
    return x.double().abs() * torch.finfo(x.dtype).eps


@pytest.mark.parametrize("name", hc.names())
@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_keeps_shape_dtype_and_layout(name: str, dtype: torch.dtype) -> None:
    c = hc.get(name)
    for shape in SHAPES + ([BIG] if dtype == torch.float32 else []):
        x = _x(shape, dtype)
        p = c.compress(x)
        y = c.decompress(p)
        assert y.shape == x.shape and y.dtype == dtype
        assert bool(torch.isfinite(y).all())
        # layout depends only on shape + config: other data (zeros) gives the same layout
        q = c.compress(torch.zeros(shape, dtype=dtype))
        assert [(t.shape, t.dtype) for t in p.tensors] == [(t.shape, t.dtype) for t in q.tensors]
        # bytes through a uint8 buffer (as a collective carries them), at an odd offset
        buf = torch.cat([torch.zeros(1, dtype=torch.uint8), p.to_buffer()])[1:]
        assert torch.equal(c.decompress(p.from_buffer(buf)), y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_casts_equal_the_cast(dtype: torch.dtype) -> None:
    x = _x((1000,), dtype)
    for name, wire in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        assert torch.equal(hc.get(name).decompress(hc.get(name).compress(x)), x.to(wire).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1000, 3000])
@pytest.mark.parametrize("offset", [0.0, 1e4])  # 1e4: chunks far from 0 (exact path)
@pytest.mark.parametrize("name", ["minmax8", "minmax4"])
def test_minmax_error_at_most_half_a_step(dtype: torch.dtype, n: int, offset: float,
                                          name: str) -> None:
    chunk = 512
    x = (_x((n,), torch.float64, seed=n) + offset).to(dtype)
    y = hc.get(name, chunk_size=chunk).decompress(hc.get(name, chunk_size=chunk).compress(x))
    xd = x.double()
    pad = torch.cat([xd, xd[-1:].expand(-(-n // chunk) * chunk - n)]).view(-1, chunk)
    steps = {"minmax8": 255, "minmax4": 15}[name]
    step = (pad.amax(1) - pad.amin(1)) / steps  # per chunk
    bound = step.repeat_interleave(chunk)[:n] / 2 * (1 + 1e-4) + 2 * _ulp(x) + 1e-30
    assert bool(((y.double() - xd).abs() <= bound).all())


@pytest.mark.parametrize("levels", [1, 3, 7, 127])
def test_qsgd_values_are_levels_of_the_bucket_norm(levels: int) -> None:
    d, x = 64, _x((1000,), torch.float64)
    c = hc.get("qsgd", levels=levels, bucket_size=d)
    y = c.decompress(c.compress(x))
    norms = torch.cat([b.norm().expand(b.numel()) for b in x.split(d)])
    lv = y / norms * levels
    assert torch.allclose(lv, lv.round(), atol=1e-9)  # integer levels
    assert bool(((y - x).abs() <= norms / levels * (1 + 1e-9)).all())  # adjacent level


def test_terngrad_sign_and_scale() -> None:
    x = _x((2000,), torch.float32)
    y = hc.get("terngrad").decompress(hc.get("terngrad").compress(x))
    s = x.abs().max()
    assert set(torch.unique(y / s).round().tolist()) <= {-1.0, 0.0, 1.0}
    assert bool((y * x >= 0).all())  # never the opposite sign
    clipped = hc.get("terngrad", clip=1.0)
    y = clipped.decompress(clipped.compress(x))
    assert math.isclose(float(y.abs().max()), float(x.std(correction=0)), rel_tol=1e-5)


def test_sign_family_hand_values() -> None:
    x = torch.tensor([0.5, -1.5, 0.0, 2.0, -3.0])
    assert hc.get("sign").decompress(hc.get("sign").compress(x)).tolist() == [1, -1, 1, 1, -1]
    ef = hc.get("efsign").decompress(hc.get("efsign").compress(x))
    assert torch.allclose(ef, torch.tensor([1.4, -1.4, 1.4, 1.4, -1.4]))
    ob = hc.get("onebit").decompress(hc.get("onebit").compress(x))
    assert torch.allclose(ob, torch.tensor([2.5 / 3, -2.25, 2.5 / 3, 2.5 / 3, -2.25]))


def test_topk_keeps_the_largest_magnitudes() -> None:
    x = _x((1000,), torch.float32)
    for config in ({"k": 10}, {"density": 0.05}, {"k": 1000}):
        y = hc.get("topk", **config).decompress(hc.get("topk", **config).compress(x))
        k = config.get("k") or 50
        want = torch.zeros_like(x)
        top = x.abs().argsort(descending=True)[:k]
        want[top] = x[top]
        assert torch.equal(y, want)


def test_approximate_topk_selects_the_exact_top_k() -> None:
    x = _x((300_000,), torch.float32)
    exact = hc.get("topk", density=0.01)
    approx = hc.get("topk", density=0.01, approximate=True)
    assert torch.equal(approx.decompress(approx.compress(x)), exact.decompress(exact.compress(x)))


def test_randomk_one_distinct_index_per_stratum() -> None:
    n, k = 103, 10
    c = hc.get("randomk", k=k, rescale=False)
    x = torch.arange(1.0, n + 1)
    idx = c.compress(x).tensors[1].long()
    bounds = torch.arange(k + 1) * n // k
    assert bool(((idx >= bounds[:-1]) & (idx < bounds[1:])).all())
    y = c.decompress(c.compress(x))
    assert int((y != 0).sum()) == k and bool((y[y != 0] == x[y != 0]).all())


def test_threshold_keeps_entries_above_and_counts_them() -> None:
    x = torch.tensor([0.5, -0.05, 0.2, -0.3, 0.01, 0.0, 0.11, -0.09])
    c = hc.get("threshold", threshold=0.1, max_density=1.0)
    p = c.compress(x)
    assert int(p.tensors[0][0]) == 4
    assert torch.equal(c.decompress(p), torch.where(x.abs() >= 0.1, x, 0.0))
    small = hc.get("threshold", threshold=0.1, max_density=0.25)  # capacity 2: largest 2
    want = torch.zeros(8)
    want[[0, 3]] = x[[0, 3]]
    assert torch.equal(small.decompress(small.compress(x)), want)


@pytest.mark.parametrize("name", hc.names())
def test_all_zeros(name: str) -> None:
    x = torch.zeros(37)
    y = hc.get(name).decompress(hc.get(name).compress(x))
    assert torch.equal(y, torch.ones(37) if name == "sign" else x)  # sign(0) counts as +1


@pytest.mark.parametrize("name", hc.names())
@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, 2.0**100),
                                              (torch.float32, 2.0**-100),
                                              (torch.float64, 2.0**900),
                                              (torch.float64, 2.0**-900)])
def test_scale_equivariance_at_extreme_magnitudes(name: str, dtype: torch.dtype,
                                                  scale: float) -> None:
    """decompress(compress(c x)) == c decompress(compress(x)): no overflow or underflow."""
    if name in ("fp16", "bf16"):
        pytest.skip("casts have their own range")
    fields = {f.name for f in dataclasses.fields(type(hc.get(name).config))}
    kw = {"seed": 3} if "seed" in fields else {}
    a, b = hc.get(name, **kw), hc.get(name, **kw)
    if name == "threshold":  # the threshold is absolute: scale it with the data
        b = hc.get(name, threshold=1e-3 * scale)
    x = _x((300,), dtype)
    ref = a.decompress(a.compress(x))
    y = b.decompress(b.compress(x * scale)) / (1.0 if name == "sign" else scale)  # sign: +-1
    assert bool(torch.isfinite(y).all())
    assert float((y - ref).norm()) <= 1e-5 * float(ref.norm())


def test_powersgd_error_never_exceeds_the_tensor() -> None:
    c = hc.get("powersgd", rank=2)
    for shape in [(1,), (10,), (6, 9), (4, 3, 5), (1000,)]:
        x = _x(shape, torch.float32)
        y = c.decompress(c.compress(x))
        # P Q^T = P P^T M projects M's columns onto span(P): ||M - P P^T M|| <= ||M||
        assert float((y - x).norm()) <= float(x.norm()) * (1 + 1e-5)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's thread count (blocks' ops run on one or two threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", hc.names())
@pytest.mark.parametrize("dtype", DTYPES)
def test_decompress_into_writes_or_adds_the_decompressed_tensor(
        name: str, dtype: torch.dtype, threads: int) -> None:
    """``decompress_into(p, out)`` == ``decompress(p)``; with ``add``, ``out + decompress``;
    the same codes with one thread or two."""
    c = hc.get(name)
    x = _x(BIG, torch.float32, seed=3)
    # fresh compressors: PowerSGD's warm start would differ on a second call
    big = hc.get(name).compress(x, torch.Generator())
    two = _compress_with_two_threads(hc.get(name), x)
    for a, b in zip(big.tensors, two.tensors):  # codes equal; float headers may round apart
        # a float header is a sum or a product of several threads' partial results: it may
        # differ by rounding relative to the largest entry (matmul blocking changes with the
        # thread count and the CPU's kernels)
        assert torch.equal(a, b) if not a.is_floating_point() else torch.allclose(
            a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
    for shape in [(7,), (9,), (3, 5), (5000,)] + ([BIG] if dtype == torch.float32 else []):
        x = _x(shape, dtype, seed=1)
        p = c.compress(x)
        dense = c.decompress(p).reshape(-1)
        out = torch.full((x.numel(),), float("nan"), dtype=dtype)
        assert c.decompress_into(p, out) is out
        assert torch.equal(out, dense)
        base = _x((x.numel(),), dtype, seed=2)
        assert torch.equal(c.decompress_into(p, base.clone(), add=True), base + dense)


def _compress_with_two_threads(c: hc.Compressor, x: torch.Tensor) -> hc.Payload:
    """``c.compress(x)`` with two torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return c.compress(x, torch.Generator())
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_above_scan_finds_every_entry_over_the_threshold_and_nan(dtype: torch.dtype) -> None:
    """The threshold scan behind top-k and threshold (numpy for float32/64 on the CPU,
    torch otherwise) returns exactly the entries with |x| >= t, NaN and Inf included, in
    order, across block boundaries."""
    from hexagram.compress.packing import block_size
    from hexagram.compress.sparsify import above

    n = block_size() * 2 + 777  # three blocks, the last one partial
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[[5, block_size(), n - 1]] = torch.tensor([float("nan"), float("inf"), -float("inf")],
                                               dtype=dtype)
    x[block_size() - 1] = 2.0  # exactly at the threshold: kept
    idx, values = above(x, 2.0)
    expect = (~(x.abs() < 2.0)).nonzero().flatten()
    assert idx.dtype == torch.int64 and torch.equal(idx, expect)
    torch.testing.assert_close(values, x[expect], rtol=0, atol=0, equal_nan=True)
    assert {5, block_size() - 1, block_size(), n - 1} <= set(idx.tolist())
    empty_idx, empty_values = above(x[:0], 1.0)
    assert empty_idx.numel() == 0 and empty_values.numel() == 0
