"""SparseLoCo, DeMo and the 4-bit outer gradients in the cost model, simulate and auto
(single process, no training)."""

from __future__ import annotations

import math

import pytest
import torch

from hexagram.algorithms import registry
from hexagram.auto import choose
from hexagram.compress.chunk_topk import ChunkTopKCompressor, ChunkTopKConfig
from hexagram.compress.dct import DCTTopKCompressor, DCTTopKConfig
from hexagram.cost.payload_size import payload_layout
from hexagram.cost.simulate import Cluster, params_compute, simulate

SHAPES = [(1,), (7,), (1000,), (33, 17), (70_000,)]


@pytest.mark.parametrize("comp", [
    ChunkTopKCompressor(), ChunkTopKCompressor(ChunkTopKConfig(chunk=300, density=0.1, bits=3)),
    DCTTopKCompressor(), DCTTopKCompressor(DCTTopKConfig(chunk=16, k=5, wire_dtype="float32")),
])
def test_stated_layout_equals_the_payload(comp: object) -> None:
    for shape in SHAPES:
        for dtype in (torch.float32, torch.float64):
            x = torch.randn(*shape, dtype=dtype)
            real = [(tuple(t.shape), t.dtype) for t in comp.compress(x).tensors]  # type: ignore[attr-defined]
            assert list(payload_layout(comp, shape, dtype) or []) == real, (shape, dtype)


def test_diloco_family_round_messages_by_hand() -> None:
    shapes, world = [(4096,), (100,)], 4
    sparse = registry.get("sparseloco", period=10)  # chunk 4096 (100: one chunk of 100)
    per = [8 + math.ceil(64 * 2 / 8) + math.ceil(64 * 12 / 8),  # 2 bin means per chunk
           8 + math.ceil(2 * 2 / 8) + math.ceil(2 * 7 / 8)]  # k = round(100 / 64) = 2
    assert sparse.round_messages(shapes, world) == [("allgather", 3 * sum(per))]
    dense = registry.get("diloco", period=10)
    assert dense.round_messages(shapes, world) == [("allreduce", 2 * 3 * 4 * 4196 // 4)]
    four = registry.get("diloco", period=10, compressor="minmax4")
    chunk = [512 + 8 * 8, 13 + 8]  # 1024 and 25 elements per rank's chunk: codes + headers
    assert four.round_messages(shapes, world) == [("alltoall", 3 * sum(chunk)),
                                                 ("allgather", 3 * sum(chunk))]
    assert dense.round_messages(shapes, 1) == []


def test_simulate_prices_the_new_algorithms() -> None:
    compute = params_compute(2_000_000, layers=8, dev="h100", samples=64)
    labels = ["diloco:period=50", "sparseloco:period=50", "diloco:period=50:compressor=minmax4",
              "decoupled_momentum", "allreduce"]
    rows = {r.label: r for r in simulate(labels, [4], compute, Cluster(inter="1gbe"))}
    fp32 = rows["diloco:period=50"].bytes
    # 4 ranks: an allgather of 1.56 % of 14-bit entries against a ring of 32-bit values,
    # 73x fewer bytes (the ratio falls as (P - 1) / (2 (P - 1) / P) with more ranks)
    assert rows["sparseloco:period=50"].bytes < fp32 / 50
    assert fp32 / 9 < rows["diloco:period=50:compressor=minmax4"].bytes < fp32 / 7
    assert 0 < rows["decoupled_momentum"].bytes < rows["allreduce"].bytes * 7 / 2
    assert all(r.step_s is not None for r in rows.values())


def test_auto_offers_sparseloco_delayed_and_demo_where_the_optimizer_allows() -> None:
    assert "sparseloco" in [lb for lb, _ in choose.resolve(None, allow_delay=True)]
    plain = dict(choose.resolve(None))
    assert "decoupled_momentum" in plain and "sparseloco" not in plain
    w = torch.nn.Parameter(torch.zeros(3))
    pair = [("decoupled_momentum", plain["decoupled_momentum"])]
    assert choose.lr_flags(pair, [torch.optim.SGD([w], lr=0.1, momentum=0.9)]) == {}
    flags = choose.lr_flags(pair, [torch.optim.AdamW([w])])
    assert "cannot take over AdamW" in flags["decoupled_momentum"]

