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


#: lengths repeated at equal distances (rows viewed in place) and not (rows gathered)
REPEATED = [64, 3, 64, 3, 64, 5, 3, 64, 1]


@pytest.mark.parametrize(("name", "config", "lengths"), [
    ("topk", {}, REPEATED), ("threshold", {}, REPEATED),
    # large single tensors take the sampled threshold on the CPU, as alone
    ("topk", {"approximate": True}, [*REPEATED, 70_000, 90_000]),
])
def test_sparsifiers_segmented_equal_per_tensor_with_repeated_lengths(
        name: str, config: dict[str, bool], lengths: list[int]) -> None:
    c, seg = hc.get(name, **config), Segments.of(lengths)
    flat = torch.randn(seg.numel, generator=torch.Generator().manual_seed(4))
    alone = [c.compress(v.clone()) for v in seg.views(flat)]
    payload = c.compress_segments(flat.clone(), seg)
    assert payload.nbytes <= sum(p.nbytes for p in alone)
    ref = torch.cat([c.decompress(p).reshape(-1) for p in alone])
    assert torch.equal(c.decompress_segments_into(payload, torch.empty(seg.numel)), ref)


def test_rows_view_where_evenly_spaced_gather_where_not() -> None:
    seg, flat = Segments.of(REPEATED), torch.arange(float(sum(REPEATED)))
    (_, first), (_, threes) = seg.by_length[0], seg.by_length[1]
    gathered = seg.rows(flat, first)  # 64s at offsets 0, 67, 134, 206: not evenly spaced
    assert gathered.data_ptr() != flat.data_ptr()
    assert torch.equal(gathered, torch.stack([flat[o:o + 64] for o in (0, 67, 134, 206)]))
    even = seg.rows(flat, first[:3])
    assert even.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert torch.equal(even, torch.stack([flat[o:o + 64] for o in (0, 67, 134)]))
    assert torch.equal(seg.rows(flat, threes), torch.stack(
        [flat[o:o + 3] for o in (64, 131, 203)]))


def test_randomk_strata_of_the_bucket_are_each_tensors_strata() -> None:
    from hexagram.compress import sparse_segments
    from hexagram.compress.sparsify import RandomKCompressor

    c, seg = hc.get("randomk", density=0.3), Segments.of(LENGTHS)
    start, size = sparse_segments.strata(seg, c.config.count, torch.device("cpu"))
    ref = [RandomKCompressor._strata(n, c.config.count(n), torch.device("cpu"))
           for n in seg.lengths]
    assert torch.equal(start, torch.cat([s + o for (s, _), o in zip(ref, seg.offsets)])
                       .double())
    assert torch.equal(size, torch.cat([z for _, z in ref]).double())
    u = torch.rand(start.numel(), dtype=torch.float64)
    positions = sparse_segments.random_positions(u, start, size)
    split = u.split([c.config.count(n) for n in seg.lengths])
    alone = [RandomKCompressor._positions(part, n) + o
             for part, n, o in zip(split, seg.lengths, seg.offsets)]
    assert torch.equal(positions, torch.cat(alone))


@pytest.mark.parametrize("name", ["topk", "randomk", "onebit", "fp16", "qsgd"])
def test_flat_error_feedback_keeps_the_invariant_per_tensor(name: str) -> None:
    config = {"rescale": False} if name == "randomk" else {}
    ef, seg = hc.ErrorFeedback(hc.get(name, **config)), Segments.of(LENGTHS)
    names = [f"t{i}" for i in range(len(LENGTHS))]
    layout = object()
    for step in range(3):
        grad = torch.randn(seg.numel, generator=torch.Generator().manual_seed(step))
        old = [ef.residual(n) for n in names]
        old_flat = torch.cat([torch.zeros(k) if r is None else r.clone()
                              for r, k in zip(old, LENGTHS)])
        flat = grad.clone()
        payload = ef.compress_flat(layout, names, LENGTHS, flat, seg)
        sent = ef.compressor.decompress_segments_into(payload, torch.empty(seg.numel))
        new = torch.cat([ef.residual(n) for n in names])  # the per-name residuals
        torch.testing.assert_close(sent + new, grad + old_flat, rtol=0, atol=1e-6)
    # the per-name residuals are views of one buffer, and outlive it in a checkpoint
    state = ef.state_dict()
    ef.reset("t0")  # unbinds: the next call binds a new buffer, t0's residual zero
    kept = ef.residual("t1").clone()
    ef.compress_flat(layout, names, LENGTHS, torch.zeros(seg.numel), seg)
    assert ef.residual("t0") is not None
    fresh = hc.ErrorFeedback(hc.get(name, **config))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.residual("t1"), state["residuals"]["t1"])
    assert kept.shape == (LENGTHS[1],)


def test_flat_error_feedback_refuses_a_residual_of_another_size() -> None:
    ef = hc.ErrorFeedback(hc.get("topk"))
    ef.update("a", torch.ones(5), torch.zeros(5))
    with pytest.raises(ValueError, match="'a'"):
        ef.compress_flat(object(), ["a"], [4], torch.ones(4), Segments.of([4]))
