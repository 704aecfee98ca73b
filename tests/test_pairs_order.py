"""The pair formats (top-k, DGC's approximate top-k, threshold, per tensor and per bucket)
send their indices strictly increasing, and a receiver's ``payload_fault`` flags any payload
whose indices are not: a repeated index (which would decode to a sum) and a reordering of
distinct ones alike, found by comparing neighbours rather than sorting what arrives."""

from __future__ import annotations

import pytest
import torch

import hexagram.compress as hc
from hexagram.compress import packing
from hexagram.compress.base import Compressor, Payload
from hexagram.compress.segments import Segments
from hexagram.compress.sparse_select import ascending

LENGTHS = [300, 7, 40000, 300]  # a repeated length; one past a block (the sampled top-k)

CASES = {
    "topk": lambda: hc.get("topk", density=0.05),
    "topk_approximate": lambda: hc.get("topk", density=0.05, approximate=True),
    "threshold": lambda: hc.get("threshold", threshold=1.0, max_density=0.2),
    "threshold_capped": lambda: hc.get("threshold", threshold=0.1, max_density=0.05),
}


def _payload(c: Compressor, segmented: bool) -> Payload:
    x = torch.randn(sum(LENGTHS), generator=torch.Generator().manual_seed(3))
    return c.compress_segments(x, Segments.of(LENGTHS)) if segmented else c.compress(x)


def _indices(p: Payload) -> torch.Tensor:
    """The used indices (threshold's per-tensor payload: the first ``count``)."""
    if len(p.tensors) == 3:
        return p.tensors[2][: int(p.tensors[0][0])]
    return p.tensors[1]


def _with_indices(p: Payload, indices: torch.Tensor) -> Payload:
    tensors = list(p.tensors)
    tensors[-1] = tensors[-1].clone()
    tensors[-1][: indices.numel()] = indices
    return Payload(tensors=tuple(tensors), shape=p.shape, dtype=p.dtype, meta=p.meta)


@pytest.mark.parametrize("fast", [True, False], ids=["cpu_fast", "device_path"])
@pytest.mark.parametrize("segmented", [False, True], ids=["tensor", "bucket"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pairs_are_sent_ascending_and_a_disorder_is_flagged(
        case: str, segmented: bool, fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packing, "CPU_FAST_PATHS", fast)
    c = CASES[case]()
    p = _payload(c, segmented)
    idx = _indices(p)
    assert idx.numel() > 2
    assert bool((idx[1:] > idx[:-1]).all()), "indices not sent strictly increasing"
    assert not bool(c.payload_fault(p))
    swapped = idx.clone()
    swapped[[0, 1]] = idx[[1, 0]]  # distinct indices, out of order
    assert bool(c.payload_fault(_with_indices(p, swapped)))
    repeated = idx.clone()
    repeated[1] = repeated[0]  # a repeat: would decode to the sum of two values
    assert bool(c.payload_fault(_with_indices(p, repeated)))


def test_dense_result_is_the_unordered_selection() -> None:
    """Sorting the pairs changes the wire order only: the decode is the top-k's."""
    c = hc.get("topk", density=0.05)
    x = torch.randn(4000, generator=torch.Generator().manual_seed(1))
    keep = torch.topk(x.abs(), c.config.count(x.numel())).indices
    dense = torch.zeros_like(x)
    dense[keep] = x[keep]
    assert torch.equal(c.decompress(c.compress(x)), dense)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_ascending_fast_path_matches_torch_sort(dtype: torch.dtype,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    idx = torch.randperm(100_000, generator=torch.Generator().manual_seed(0))[:5000]
    idx = idx.to(dtype)
    monkeypatch.setattr(packing, "CPU_FAST_PATHS", True)
    fast = ascending(idx)
    monkeypatch.setattr(packing, "CPU_FAST_PATHS", False)
    assert fast.dtype == dtype and torch.equal(fast, ascending(idx))
    assert torch.equal(fast, torch.sort(idx).values)
