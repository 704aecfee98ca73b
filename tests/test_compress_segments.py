"""Several tensors compressed in one call: ``compress_segments`` keeps layer-wise semantics.

Every registered compressor's segmented payload decodes, segment by segment, to what a
per-tensor ``compress`` decodes to (bit for bit for deterministic formats), with at most the
per-tensor wire size.
"""

from __future__ import annotations

import pytest
import torch

import hexagram.compress as hc
from hexagram.compress.segments import Segments

#: formats that draw random numbers, or keep state between calls (PowerSGD's warm start):
#: compared in distribution elsewhere, here by shape and linearity only
STOCHASTIC = {"qsgd", "terngrad", "randomk", "powersgd"}
LENGTHS = [300, 7, 1, 64, 1025]


@pytest.mark.parametrize("name", hc.names())
def test_segments_decode_like_each_tensor_alone(name: str) -> None:
    c, seg = hc.get(name), Segments.of(LENGTHS)
    flat = torch.randn(seg.numel, generator=torch.Generator().manual_seed(1))
    alone = [c.compress(v.clone()) for v in seg.views(flat)]
    payload = c.compress_segments(flat.clone(), seg)
    assert payload.meta["segments"] is seg and payload.shape == torch.Size([seg.numel])
    assert payload.nbytes <= sum(p.nbytes for p in alone)
    out = c.decompress_segments_into(payload, torch.full((seg.numel,), 7.0))
    if name not in STOCHASTIC:
        ref = torch.cat([c.decompress(p).reshape(-1) for p in alone])
        assert torch.equal(out, ref)
    added = c.decompress_segments_into(payload, torch.ones(seg.numel), add=True)
    torch.testing.assert_close(added, out + 1)


def test_segments_survive_the_wire() -> None:
    c, seg = hc.get("onebit"), Segments.of(LENGTHS)
    flat = torch.randn(seg.numel)
    payload = c.compress_segments(flat, seg)
    received = payload.from_buffer(payload.to_buffer().clone())
    assert torch.equal(c.decompress_segments_into(received, torch.empty(seg.numel)),
                       c.decompress_segments_into(payload, torch.empty(seg.numel)))


def test_segments_refuse_empty_layouts() -> None:
    with pytest.raises(ValueError, match="length"):
        Segments.of([3, 0])
    with pytest.raises(ValueError, match="at least one"):
        Segments.of([])


def test_segment_index_and_expand_are_cached_per_device() -> None:
    seg = Segments.of([2, 1, 3])
    cpu = torch.device("cpu")
    assert seg.index(cpu).tolist() == [0, 0, 1, 2, 2, 2]
    assert seg.index(cpu) is seg.index(cpu)
    assert seg.expand(torch.tensor([[1.0], [2.0], [3.0]]), cpu).flatten().tolist() == \
        [1.0, 1.0, 2.0, 3.0, 3.0, 3.0]
