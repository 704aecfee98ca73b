"""Payload.nbytes: the bytes of the tensors sent, equal to each documented formula."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import hexagram.compress as hc
from hexagram.compress.lowrank import matrix_shape
from hexagram.compress.packing import pack_codes, packed_nbytes, unpack_codes


def _formula(name: str, n: int, itemsize: int) -> int:
    """Wire bytes of ``n`` elements (float32 headers; ``itemsize`` of the input dtype)."""
    def k(d: float) -> int:
        return max(1, math.ceil(d * n))

    return {
        "fp16": 2 * n,
        "bf16": 2 * n,
        "minmax8": n + 8 * math.ceil(n / 1024),
        "minmax4": math.ceil(n / 2) + 8 * math.ceil(n / 128),
        "qsgd": math.ceil(n * 4 / 8) + 4 * math.ceil(n / 512),  # 7 levels: 4 bits
        "terngrad": math.ceil(n * 2 / 8) + 4,
        "sign": math.ceil(n / 8),
        "efsign": math.ceil(n / 8) + 4,
        "onebit": math.ceil(n / 8) + 8,
        "topk": k(0.01) * (itemsize + 4),
        "randomk": k(0.01) * (itemsize + 4),
        "threshold": 4 + k(0.01) * (itemsize + 4),
        "powersgd": sum(matrix_shape(torch.Size([n]))) * min(2, *matrix_shape(
            torch.Size([n]))) * 4,
    }[name]


@pytest.mark.parametrize("name", hc.names())
@pytest.mark.parametrize("n", [1, 9, 1000, 4097, 40000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nbytes_is_the_documented_formula(name: str, n: int, dtype: torch.dtype) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    p = hc.get(name).compress(x)
    sent = sum(t.numel() * t.element_size() for t in p.tensors)
    assert p.nbytes == sent == p.to_buffer().numel()
    assert p.nbytes == _formula(name, n, x.element_size())


@pytest.mark.parametrize(("levels", "bits"), [(1, 2), (2, 3), (3, 3), (4, 4), (7, 4), (8, 5),
                                              (15, 5), (31, 6), (63, 7), (127, 8)])
def test_qsgd_bits_are_ceil_log2_of_2s_plus_1(levels: int, bits: int) -> None:
    assert bits == math.ceil(math.log2(2 * levels + 1))
    n = 1001
    p = hc.get("qsgd", levels=levels, bucket_size=100).compress(torch.randn(n))
    assert p.nbytes == math.ceil(n * bits / 8) + 4 * 11


def test_float64_headers_are_8_bytes() -> None:
    x = torch.randn(2000, dtype=torch.float64)
    assert hc.get("minmax8").compress(x).nbytes == 2000 + 16 * 2
    assert hc.get("onebit").compress(x).nbytes == 250 + 16
    assert hc.get("topk").compress(x).nbytes == 20 * (8 + 4)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_every_width_and_odd_size(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    for n in [*range(0, 18), 1000, 70001]:
        codes = torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.uint8)
        packed = pack_codes(codes, bits)
        assert packed.numel() == packed_nbytes(n, bits) == math.ceil(n * bits / 8)
        into = torch.full((packed.numel(),), 255, dtype=torch.uint8)  # stale bytes overwritten
        assert torch.equal(pack_codes(codes, bits, out=into), packed)
        assert torch.equal(unpack_codes(packed, bits, n), codes)


def test_pack_layout_by_hand() -> None:
    codes = [1, 2, 3, 4, 5, 6, 7, 0, 5]  # 3-bit codes, little-endian within 8-code groups
    word = sum(c << (3 * i) for i, c in enumerate(codes[:8]))
    want = [*word.to_bytes(3, "little"), 5]
    assert pack_codes(torch.tensor(codes, dtype=torch.uint8), 3).tolist() == want
    assert pack_codes(torch.tensor([1, 0, 0, 1, 1, 0, 0, 0, 1], dtype=torch.uint8),
                      1).tolist() == [0b00011001, 1]


def test_aggregation_of_each_compressor() -> None:
    want = {"fp16": "sum", "bf16": "sum", "powersgd": "sum", "minmax8": "scatter_gather",
            "minmax4": "scatter_gather", "qsgd": "scatter_gather"}
    for name in hc.names():
        assert hc.get(name).aggregation.value == want.get(name, "gather"), name


def test_summable_payloads_add_up_in_compressed_form() -> None:
    """SUM: summing fp16 payload tensors then decompressing == summing the decompressed."""
    a, b = torch.randn(100), torch.randn(100)
    c = hc.get("fp16")
    pa, pb = c.compress(a), c.compress(b)
    total = dataclasses.replace(pa, tensors=(pa.tensors[0] + pb.tensors[0],))
    assert torch.equal(c.decompress(total), (a.half() + b.half()).float())


def test_unknown_compressor_lists_the_names() -> None:
    with pytest.raises(ValueError, match="qsgd"):
        hc.get("qsgd2")
