"""Whole-bucket ``compress_segments`` of the quantizers and sign compressors.

Deterministic formats decode, segment by segment, to the bits of each tensor compressed
alone (on the CPU's path and on the path CUDA takes); QSGD and TernGrad keep the
per-tensor scales and stay unbiased; the number of dispatched ops does not grow with the
number of segments.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hexagram.compress as hc
from hexagram.compress import packing
from hexagram.compress.combine import decode_sum
from hexagram.compress.segments import Segments

DETERMINISTIC: list[tuple[str, dict[str, Any]]] = [
    ("minmax8", {}), ("minmax4", {}), ("minmax8", {"chunk_size": 64}), ("sign", {}),
    ("sign", {"scaled": True}), ("efsign", {}), ("onebit", {}), ("efsign", {"block": 256}),
    ("onebit", {"block": 256}), ("onebit", {"block": 7})]
STOCHASTIC: list[tuple[str, dict[str, Any]]] = [("qsgd", {}), ("qsgd", {"levels": 1}),
                                                ("qsgd", {"levels": 127}), ("terngrad", {})]
#: awkward lengths: shorter than a chunk, whole chunks (128 of minmax4, 256 blocks), odd
LENGTHS = [300, 7, 1, 64, 1025, 512, 4096, 513, 128]


@pytest.fixture(params=["cpu", "device"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    packing.CPU_FAST_PATHS = request.param == "cpu"
    try:
        yield request.param
    finally:
        packing.CPU_FAST_PATHS = True


def _flat(seg: Segments, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    x = torch.randn(seg.numel, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64)
    x[::11] = 0.0
    for i, view in enumerate(seg.views(x)):  # segments of different magnitude and offset
        view.mul_(10.0 ** (i % 5 - 2)).add_(3.0 * (i % 3 == 1))
    return x.to(dtype)


def _per_tensor(c: hc.Compressor, flat: torch.Tensor, seg: Segments) -> torch.Tensor:
    return torch.cat([c.decompress(c.compress(v.clone())).reshape(-1) for v in seg.views(flat)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("name", "config"), DETERMINISTIC)
def test_deterministic_formats_decode_like_each_tensor(name: str, config: dict[str, Any],
                                                       dtype: torch.dtype, path: str) -> None:
    c, seg = hc.get(name, **config), Segments.of(LENGTHS)
    flat = _flat(seg, dtype)
    payload = c.compress_segments(flat, seg)
    alone = [c.compress(v.clone()) for v in seg.views(flat)]
    assert payload.nbytes <= sum(p.nbytes for p in alone)
    out = c.decompress_segments_into(payload, torch.full((seg.numel,), 5.0, dtype=dtype))
    assert torch.equal(out, _per_tensor(c, flat, seg))
    ones = torch.ones(seg.numel, dtype=dtype)
    assert torch.equal(c.decompress_segments_into(payload, ones.clone(), add=True),
                       ones + out)
    # decompress_into takes a bucket's payload too (decode_sum's fallback calls it)
    assert torch.equal(c.decompress_into(payload, torch.empty_like(out)), out)


@pytest.mark.parametrize(("name", "config"), DETERMINISTIC[:3])
def test_minmax_cpu_decisions_per_tensor(name: str, config: dict[str, Any]) -> None:
    """Tensors whose ranges overflow float32, beside ordinary ones and ones far from 0
    (the CPU's float64 and unfused forms, decided per tensor): still each tensor's bits."""
    c, seg = hc.get(name, **config), Segments.of(LENGTHS)
    for huge in (False, True):
        flat = _flat(seg)
        flat[300:307] = torch.tensor([3e38, -3e38, 1.0, 0.0, 2e38, -1e38, 5.0]) if huge \
            else flat[300:307] + 1000.0
        out = c.decompress_segments_into(c.compress_segments(flat, seg),
                                         torch.empty(seg.numel))
        assert torch.equal(out, _per_tensor(c, flat, seg))


@pytest.mark.parametrize(("name", "config"), STOCHASTIC)
def test_stochastic_formats_keep_the_per_tensor_scales(name: str, config: dict[str, Any],
                                                       path: str) -> None:
    c, seg = hc.get(name, **config), Segments.of(LENGTHS)
    flat = _flat(seg)
    payload = c.compress_segments(flat, seg)
    alone = [c.compress(v.clone()) for v in seg.views(flat)]
    assert payload.nbytes <= sum(p.nbytes for p in alone)
    assert torch.equal(payload.tensors[0], torch.cat([p.tensors[0] for p in alone]))
    out = c.decompress_segments_into(payload, torch.empty(seg.numel))
    assert torch.equal(c.decompress_segments_into(payload, torch.ones(seg.numel), add=True),
                       out + 1)
    if name == "terngrad":  # every decoded value is -s, 0 or s of its own tensor's s
        for p, got in zip(alone, seg.views(out)):
            s = p.tensors[0]
            assert bool(torch.isin(got, torch.cat([-s, s, s * 0])).all())


@pytest.mark.parametrize(("name", "config"), STOCHASTIC)
def test_stochastic_formats_are_unbiased(name: str, config: dict[str, Any], path: str) -> None:
    """2000 copies of a 64-element tensor as 2000 segments: 2000 independent draws, each
    with its own scale, whose mean is within 5 standard errors of the tensor."""
    draws, x = 2000, torch.randn(64, generator=torch.Generator().manual_seed(3),
                                 dtype=torch.float64)
    c, seg = hc.get(name, seed=4, **config), Segments.of([64] * draws)
    y = c.decompress_segments_into(c.compress_segments(x.repeat(draws), seg),
                                   torch.empty(64 * draws, dtype=torch.float64))
    y = y.view(draws, 64)
    mean, se = y.mean(0), y.std(0) / draws**0.5
    z = (mean - x).abs() / se.clamp_min(1e-300)
    assert float(z[se > 0].max()) < 5.0
    assert bool(((mean - x).abs()[se == 0] < 1e-12).all())


@pytest.mark.parametrize("name", ["sign", "efsign", "onebit", "terngrad"])
def test_code_space_sum_of_bucket_payloads(name: str) -> None:
    """``sign`` keeps its one table (+-1) for a bucket; the formats with a scale per
    segment return no table and decode_sum decodes them: the same sums either way."""
    c, seg = hc.get(name), Segments.of(LENGTHS)
    payloads = [c.compress_segments(_flat(seg, seed=s), seg) for s in range(3)]
    assert (c.code_table(payloads[0]) is not None) == (name == "sign")
    got = decode_sum(c, payloads, torch.empty(seg.numel))
    want = torch.zeros(seg.numel)
    for p in payloads:
        want += c.decompress_segments_into(p, torch.empty(seg.numel))
    assert torch.equal(got, want)


def test_bad_buffers_are_refused() -> None:
    c, seg = hc.get("minmax8"), Segments.of([3, 4])
    with pytest.raises(ValueError, match="1-D buffer of 7"):
        c.compress_segments(torch.zeros(8), seg)
    with pytest.raises(TypeError, match="int64"):
        c.compress_segments(torch.zeros(7, dtype=torch.int64), seg)
    payload = c.compress_segments(torch.zeros(7), seg)
    with pytest.raises(ValueError, match="chunk headers"):
        c.decompress_segments_into(payload.__class__(
            payload.tensors, payload.shape, payload.dtype,
            {"segments": Segments.of([7])}), torch.empty(7))


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(name: str, segments: int, config: dict[str, Any] | None = None) -> int:
    """Aten ops dispatched by one ``compress_segments`` + ``decompress_segments_into`` of
    ``segments`` tensors of 1000 elements (on the path CUDA takes)."""
    c, seg = hc.get(name, **(config or {})), Segments.of([1000] * segments)
    flat, out = torch.randn(seg.numel), torch.empty(seg.numel)
    c.decompress_segments_into(c.compress_segments(flat, seg), out)  # layouts cached
    with _OpCounter() as counter:
        c.decompress_segments_into(c.compress_segments(flat, seg), out)
    return sum(counter.ops.values())


@pytest.mark.parametrize(("name", "config"), DETERMINISTIC + STOCHASTIC)
def test_op_count_does_not_grow_with_segments(name: str, config: dict[str, Any],
                                              device_path: None) -> None:
    assert count_ops(name, 128, config) == count_ops(name, 8, config)


def test_terngrad_clipped_scales_per_segment_match_each_tensor_alone() -> None:
    from hexagram.compress.segments import Segments

    seg = Segments.of([300, 7, 1, 64, 1025])
    x = torch.randn(seg.numel, generator=torch.Generator().manual_seed(3)) \
        * torch.linspace(0.1, 3.0, seg.numel) + 0.5
    c = hc.get("terngrad", clip=2.5)
    scales = c.compress_segments(x.clone(), seg).tensors[0]
    alone = torch.stack([c.compress(v.clone()).tensors[0].reshape(()) for v in seg.views(x)])
    torch.testing.assert_close(scales, alone, rtol=1e-5, atol=0.0)
    assert "parts" not in c.compress_segments(x.clone(), seg).meta  # one call, no loop
