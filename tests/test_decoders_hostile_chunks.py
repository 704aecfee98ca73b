"""The per-chunk formats (SparseLoCo's chunked top-k, DeMo's DCT top-k), per tensor and
over many tensors at once, are safe on hostile bytes: random, bit-flipped or
garbage-tailed payloads of the right size never raise a torch error (no position leaves
its chunk: on a GPU no device-side assert), and a decode that is not finite is flagged
(``payload_fault``, or the flags the flat codecs' ``decode`` hands back). Valid payloads
are never flagged and decode as before, bit for bit.

Chunks of 12 (positions in 4 bits can name 16) and a short last chunk exercise the clamp.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hexagram.compress.base import Payload
from hexagram.compress.chunk_topk import ChunkTopKCompressor, ChunkTopKConfig
from hexagram.compress.chunk_topk_flat import ChunkTopKRows, Sparse
from hexagram.compress.dct import DCTTopKCompressor, DCTTopKConfig
from hexagram.compress.dct_flat import DCTTopKRows
from hexagram.compress.faults import any_of

NUMELS = (37, 5, 24)
SETTINGS = settings(max_examples=15, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
FORMATS = ["chunktopk", "dcttopk", "chunktopk_rows", "dcttopk_rows"]


def _codec(name: str) -> Any:
    if name.startswith("chunktopk"):
        cfg: Any = ChunkTopKConfig(chunk=12, density=0.25, bits=2)
        return ChunkTopKCompressor(cfg) if name == "chunktopk" else \
            ChunkTopKRows(cfg, list(NUMELS), torch.float32)
    cfg = DCTTopKConfig(chunk=12, k=3, wire_dtype="float32")
    return DCTTopKCompressor(cfg) if name == "dcttopk" else \
        DCTTopKRows(cfg, list(NUMELS), torch.float32)


def _encode(name: str, codec: Any, seed: int) -> tuple[Payload, int]:
    x = torch.randn(sum(NUMELS), generator=torch.Generator().manual_seed(seed))
    if not name.endswith("_rows"):
        return codec.compress(x), x.numel()
    flat = torch.zeros(codec.layout.numel)
    for view, part in zip(codec.layout.views(flat), x.split(list(NUMELS))):
        view.copy_(part)
    return codec.encode(flat)[0], codec.layout.numel


def _decode(name: str, codec: Any, p: Payload, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoded values, malformed flag)."""
    if not name.endswith("_rows"):
        return codec.decompress(p).reshape(-1), codec.payload_fault(p)
    faults: list[torch.Tensor] = []
    sparse: Sparse = codec.decode(p, faults)
    out = torch.zeros(n)
    if name == "chunktopk_rows":
        codec.add_into(out, sparse)
    else:
        codec.inverse([sparse], out)
    return out, any_of(faults)


def _corrupt(buf: torch.Tensor, how: str, data: st.DataObject) -> torch.Tensor:
    n, raw = buf.numel(), buf.clone()
    if how == "random":
        return torch.tensor(list(data.draw(st.binary(min_size=n, max_size=n))),
                            dtype=torch.uint8)
    if how == "tail":
        cut = data.draw(st.integers(0, n - 1))
        raw[cut:] = torch.tensor(list(data.draw(st.binary(min_size=n - cut,
                                                          max_size=n - cut))),
                                 dtype=torch.uint8)
        return raw
    for byte, bit in data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 7)),
                                        min_size=1, max_size=4)):
        raw[byte] ^= 1 << bit
    return raw


@pytest.mark.parametrize("name", FORMATS)
@SETTINGS
@given(data=st.data())
def test_hostile_bytes_never_raise_and_bad_results_are_flagged(name: str,
                                                               data: st.DataObject) -> None:
    codec = _codec(name)
    p, n = _encode(name, codec, data.draw(st.integers(0, 3)))
    how = data.draw(st.sampled_from(["random", "tail", "flip"]))
    bad = p.from_buffer(_corrupt(p.to_buffer(), how, data))
    out, flag = _decode(name, codec, bad, n)
    assert flag.shape == () and flag.dtype == torch.bool
    assert out.shape == (n,)
    assert bool(torch.isfinite(out).all()) or bool(flag), f"{name} ({how}): unflagged NaN/Inf"


@pytest.mark.parametrize("name", FORMATS)
def test_valid_payload_is_not_flagged_and_decodes_unchanged(name: str) -> None:
    codec = _codec(name)
    for seed in range(3):
        p, n = _encode(name, codec, seed)
        a, flag = _decode(name, codec, p, n)
        b, again = _decode(name, codec, p.from_buffer(p.to_buffer()), n)
        assert not bool(flag) and not bool(again)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("name", FORMATS)
def test_positions_past_the_chunk_are_clamped_and_flagged(name: str) -> None:
    codec = _codec(name)
    p, n = _encode(name, codec, 0)
    tensors = [t if t.is_floating_point() else torch.full_like(t, 0xFF) for t in p.tensors]
    out, flag = _decode(name, codec, Payload(tuple(tensors), p.shape, p.dtype), n)
    assert bool(flag) and out.shape == (n,)  # every position 15 (> 11): no IndexError
