"""The DiLoCo family and DeMo on flat, chunk-padded buffers.

- the flat formats equal the per-tensor compressors: chunked top-k bit for bit (payload
  values, decode, wire bytes), the DCT within float32 rounding (bit for bit in float64),
  whatever the alignment of the packed codes;
- a peer's positions past a row are clamped and their values dropped;
- the aten ops a step adds do not grow with the number of parameter tensors (world 1);
- a NaN weight on one rank stops every rank at the same SparseLoCo round (one read).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from hexagram.compress.chunk_rows import ChunkRows, SegmentPacker
from hexagram.compress.chunk_topk import ChunkTopKCompressor, ChunkTopKConfig, chunk_layout
from hexagram.compress.chunk_topk_flat import ChunkTopKRows
from hexagram.compress.dct import DCTTopKCompressor, DCTTopKConfig
from hexagram.compress.dct_flat import DCTTopKRows
from hexagram.compress.packing import pack_codes
from hexagram.launch import run_local

NUMELS = [1, 7, 1000, 561, 70_000, 3, 7, 4096, 8197, 64, 2, 30, 85, 1200]


def _laid_out(layout: ChunkRows, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A flat buffer of ``layout`` holding random tensors, and the tensors."""
    xs = [torch.randn(n, dtype=dtype) for n in layout.numels]
    flat = torch.zeros(layout.numel, dtype=dtype)
    for view, x in zip(layout.views(flat), xs):
        view.copy_(x)
    return flat, xs


def _padding(layout: ChunkRows, flat: torch.Tensor) -> torch.Tensor:
    keep = torch.ones_like(flat, dtype=torch.bool)
    for view in layout.views(keep):
        view.fill_(False)
    return flat[keep]


@pytest.mark.parametrize("config", [
    ChunkTopKConfig(), ChunkTopKConfig(chunk=64, density=0.1),
    ChunkTopKConfig(chunk=300, density=0.1, bits=3),  # 9-bit positions, unaligned codes
    ChunkTopKConfig(chunk=1000, density=0.013, bits=5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_chunk_topk_rows_equal_the_per_tensor_compressor(config: ChunkTopKConfig,
                                                         dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    rows, single = ChunkTopKRows(config, NUMELS, dtype), ChunkTopKCompressor(config)
    flat, xs = _laid_out(rows.layout, dtype)
    payloads = [single.compress(x) for x in xs]
    payload, sent, nonfinite = rows.encode(flat)
    assert payload.nbytes == rows.nbytes == sum(p.nbytes for p in payloads)
    assert not bool(nonfinite)
    own = rows.add_into(torch.zeros_like(flat), sent)
    assert torch.equal(own, rows.add_into(torch.zeros_like(flat), rows.decode(payload)))
    for view, p in zip(rows.layout.views(own), payloads):
        assert torch.equal(view, single.decompress(p).reshape(-1))
    assert not _padding(rows.layout, own).any()  # what a top-k picked there is dropped
    flat[5] = float("nan")
    assert bool(rows.encode(flat)[2])


@pytest.mark.parametrize("config", [
    DCTTopKConfig(), DCTTopKConfig(chunk=8, k=3, wire_dtype="float32"),
    DCTTopKConfig(chunk=100, k=7, wire_dtype="float16")])
def test_dct_rows_equal_the_per_tensor_compressor(config: DCTTopKConfig) -> None:
    torch.manual_seed(0)
    single = DCTTopKCompressor(config)
    for dtype, tol in ((torch.float64, 0.0), (torch.float32, 1e-6)):
        rows = DCTTopKRows(config, NUMELS, dtype)
        flat, xs = _laid_out(rows.layout, dtype)
        payloads = [single.compress(x) for x in xs]
        payload, sent = rows.encode(flat)
        assert payload.nbytes == rows.nbytes == sum(p.nbytes for p in payloads)
        dense = rows.inverse([sent], torch.empty_like(flat))
        assert torch.equal(dense, rows.inverse([rows.decode(payload)], torch.empty_like(flat)))
        for view, p in zip(rows.layout.views(dense), payloads):  # float32: matmul blocking
            assert float((view - single.decompress(p).reshape(-1)).abs().max()) <= tol
        assert not _padding(rows.layout, dense).any()
        twice = rows.inverse([sent, sent], torch.empty_like(flat))  # linear: one transform
        assert torch.allclose(twice, 2 * dense, atol=1e-6)


def test_segment_packer_gives_the_per_tensor_bytes() -> None:
    g = torch.Generator().manual_seed(0)
    for bits in range(1, 9):
        for lengths in ([8, 16], [3, 5, 1, 13], [7]):
            codes = [torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.uint8)
                     for n in lengths]
            packer = SegmentPacker(lengths, bits)
            packed = packer.pack(torch.cat(codes))
            assert torch.equal(packed, torch.cat([pack_codes(c, bits) for c in codes]))
            assert packed.numel() == packer.nbytes
            assert torch.equal(packer.unpack(packed), torch.cat(codes))


def test_layout_groups_rows_by_format_and_peers_cannot_write_outside() -> None:
    config = ChunkTopKConfig(chunk=100, density=0.05, bits=2)  # 7-bit positions name 127
    layout = ChunkRows([250, 40, 40, 100], lambda n: chunk_layout(config, n))
    assert [(g.width, g.rows, g.limits) for g in layout.groups] == \
        [(100, 4, (100, 100, 50, 100)), (40, 2, (40, 40))]
    rows = ChunkTopKRows(config, [250, 40, 40, 100], torch.float32)
    payload, _, _ = rows.encode(torch.randn(rows.layout.numel))
    packed = list(payload.tensors)
    packed[2] = torch.full_like(packed[2], 255)  # every position 127: past every row
    hostile = rows.decode(type(payload)(tuple(packed), payload.shape, payload.dtype))
    assert int(hostile.pos[0].max()) == 99 and not hostile.values[0].any()
    short = type(payload)(tuple(packed[:1] + packed[2:]), payload.shape, payload.dtype)
    with pytest.raises(ValueError, match="another config"):
        rows.decode(short)


ALGOS: dict[str, dict[str, Any]] = {"diloco": {"period": 2}, "sparseloco": {"period": 2},
                                    "local_sgd": {"period": 2}, "decoupled_momentum": {},
                                    "allreduce": {}}


def _ops(algo: str | None, layers: int) -> int:
    """Aten ops of two steps (the second communicates) of ``layers`` Linear(16, 16)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import hexagram as hx

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            Count.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    model: nn.Module = net
    if algo is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = hx.DistributedDataParallel(net, optimizers=[opt],
                                               algorithm=hx.algorithms.get(algo, **ALGOS[algo]))
    x = torch.randn(4, 16)
    for counted in (False, True):  # the first two steps set up (buckets, layouts)
        with Count() if counted else contextlib.nullcontext():
            for _ in range(2):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    return Count.n


def _op_counts() -> dict[str, list[int]]:
    import hexagram as hx

    hx.init()
    out = {}
    for algo in ALGOS:
        out[algo] = [_ops(algo, n) - _ops(None, n) for n in (8, 32)]
    return out


def test_ops_a_step_adds_do_not_grow_with_the_number_of_tensors() -> None:
    counts = run_local(_op_counts, 1, timeout=120)[0]
    # the engine's per-tensor gradient hooks (allreduce's growth) are all a gradient
    # algorithm may add per tensor; the weight algorithms have none
    hooks = counts["allreduce"][1] - counts["allreduce"][0]
    for algo, (few, many) in counts.items():  # 16 and 64 tensors, one bucket each
        grows = hooks if algo in ("decoupled_momentum", "allreduce") else 0
        assert 0 < few and many <= few + grows + 2, f"{algo}: {few} ops (16 tensors), {many} (64)"
    assert counts["sparseloco"][1] < 300 and counts["decoupled_momentum"][1] < 600, counts


def _nan_round() -> tuple[str, int]:
    """Rank 1's weight turns NaN after step 3; the round after step 4 must stop both."""
    import torch.distributed as dist

    import hexagram as hx

    hx.init()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 300), nn.Linear(300, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=hx.algorithms.get(
        "sparseloco", period=2, chunk=64))
    for step in range(1, 7):
        try:
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()  # a round follows steps 2, 4, 6
        except hx.NonFiniteGradientError as e:
            return str(e), step
        opt.zero_grad()
        if step == 3 and dist.get_rank() == 1:
            with torch.no_grad():
                net[1].weight[0, 3] = float("nan")
    return "no error", -1


def test_nan_weight_stops_every_rank_at_the_same_round() -> None:
    for rank, (message, step) in enumerate(run_local(_nan_round, 2, timeout=120)):
        assert step == 4, f"rank {rank}: {message}"
        assert "NaN or Inf on 1 rank(s)" in message, message
        where = "here first in parameter" if rank == 1 else "on another rank"
        assert where in message, message
