"""Every registered compressor and algorithm carries the facts the cost model prices it by
(``hexagram.cost.facts``): a new one that forgets one fails here, not in a side table."""

from __future__ import annotations

import pytest
import torch

import hexagram.compress as hc
from hexagram.algorithms import registry
from hexagram.algorithms.labels import make, parse_label
from hexagram.cost.facts import Priced, compressor_of
from hexagram.cost.model import predict_any
from hexagram.cost.payload_size import declares_layout, payload_nbytes
from hexagram.cost.probe import COLLECTIVES, Fit, NetworkProfile
from hexagram.cost.profile import ComputeProfile, TreeCost
from hexagram.cost.schedule import TensorSpec, step_schedule
from hexagram.parallel.relax_cost import PRICED, wire_bytes

SIZES = [(1,), (1000,), (33, 17)]
LAYOUT = [[TensorSpec("a", (64, 32)), TensorSpec("b", (32,))], [TensorSpec("c", (4097,))]]
ALGORITHMS = [n for n in registry.names() if n != "auto"]  # auto prices its candidates


@pytest.mark.parametrize("name", hc.names())
def test_every_compressor_declares_its_wire_size_and_passes(name: str) -> None:
    comp = hc.get(name)
    assert declares_layout(comp), f"{name}: declare wire_layout(shape, dtype) on its class"
    gen = torch.Generator().manual_seed(0)
    for shape in SIZES:
        real = comp.compress(torch.randn(*shape, generator=gen), gen).nbytes
        assert payload_nbytes(comp, shape) == real, (name, shape)
    assert comp.memory_passes is not None and comp.memory_passes > 0, \
        f"{name}: declare memory_passes on its class (the planner prices encode by it)"


def test_the_per_chunk_compressors_declare_their_passes() -> None:
    """SparseLoCo's and DeMo's compressors (not in the compressor registry) too, and a
    config that adds a pass says so."""
    from hexagram.compress.chunk_topk import ChunkTopKCompressor
    from hexagram.compress.dct import DCTTopKCompressor
    from hexagram.compress.signs import SignCompressor, SignVoteConfig

    for comp in (ChunkTopKCompressor(), DCTTopKCompressor()):
        assert comp.memory_passes is not None and comp.memory_passes > 0, comp.name
    plain, scaled = SignCompressor(), SignCompressor(SignVoteConfig(scaled=True))
    assert scaled.memory_passes == plain.memory_passes + 1  # type: ignore[operator]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_has_a_priced_step(name: str) -> None:
    algo = registry.get(name)
    if algo.kind == "grad":
        for world, hosts in ((2, 1), (8, 2)):
            msgs = step_schedule(algo, LAYOUT, world, hosts=hosts)
            assert len(msgs) == len(LAYOUT) and all(msgs), (name, world)
            # every bucket sends something (a message may be empty: PowerSGD's Q of a vector)
            assert all(sum(m.sent for m in b) > 0 for b in msgs), (name, world)
            assert all(m.sent >= 0 and m.rounds >= 1 for b in msgs for m in b), (name, world)
    tensors = [t for bucket in LAYOUT for t in bucket]
    compute = ComputeProfile(0.001, 0.002, 0.0005, tensors, [0.002] * len(tensors))
    net = NetworkProfile(4, 2, {k: Fit(1e-5, 1e8) for k in COLLECTIVES})
    p = predict_any(algo, compute, net)
    assert p.step_s >= compute.step_s and p.wire_bytes > 0, name
    if algo.own_work:  # its own CPU is timed, and only then
        assert isinstance(algo.own_work_cost(((16, 16), (64, 64))), TreeCost), name
        assert compressor_of(algo) is not None
    else:
        assert algo.own_work_cost(((16, 16), (64, 64))) is None


def test_auto_candidacy_names_its_own_entry_and_makes() -> None:
    for entry in registry.entries().values():
        for label in entry.auto.labels if entry.auto else ():
            assert parse_label(label)[0] == entry.name, label
            algo = make(label)
            assert (algo.kind == "weight") == entry.auto.delayed, label  # type: ignore[union-attr]


def test_planner_priced_algorithms_declare_their_passes() -> None:
    assert PRICED == registry.planner_priced() and "allreduce" in PRICED
    assert set(registry.planner_options()) == set(PRICED)
    for name in PRICED:
        comp = compressor_of(registry.get(name))
        assert comp is None or comp.memory_passes is not None, name
        assert wire_bytes(name, (64, 32), 4)[0] > 0, name


class _Plain:
    """An object that is no Algorithm but has the interface's members: the cost model prices
    it (the interface is all it reads), here as a plain exact-sum allreduce."""

    name, kind, config = "plain", "grad", None
    own_work = exchange_overlap = ""
    granularity = "layer"
    passes_nonfinite = True  # an exact sum carries NaN/Inf: no per-step agreement

    def priced_as(self) -> _Plain:
        return self

    def wire_messages(self, bucket: object, world: int, rank: int) -> None:
        return None

    def own_work_cost(self, sizes: object, device: object = "cpu") -> None:
        return None

    def gathered_decodes(self, world: int) -> int:
        return world


def test_the_cost_model_prices_any_object_with_the_interface() -> None:
    plain: Priced = _Plain()
    want = step_schedule(registry.get("allreduce"), LAYOUT, 8, hosts=2)
    assert step_schedule(plain, LAYOUT, 8, hosts=2) == want
