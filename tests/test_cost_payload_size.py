"""Analytic payload sizes (``hexagram.cost.payload_size``) equal the real compressed payloads.

Every registered compressor, several configurations each, at odd, 1-D, matrix and 3-D
shapes and in three input dtypes: the layout from the formulas must equal the shapes and
dtypes of the tensors ``compress`` really returns (so also ``Payload.nbytes``). The
schedules of every registered algorithm must be the same message for message whether their
payloads are compressed or sized from formulas, and ``simulate()`` must give the same rows.
"""

from __future__ import annotations

import pytest
import torch

import hexagram.compress as hc
from hexagram.algorithms import registry
from hexagram.algorithms.labels import simulable
from hexagram.auto.choose import make
from hexagram.auto.simulate import simulate
from hexagram.compress.base import Aggregation, Compressor, Payload
from hexagram.cost.payload_size import (
    declares_layout,
    meta_payload,
    payload_layout,
    payload_nbytes,
)
from hexagram.cost.schedule import (
    TensorSpec,
    analytic_payloads,
    payload_of,
    sizing_times,
    step_schedule,
)
from hexagram.cost.simulate import Cluster, _simulate, params_compute

SHAPES = [(1,), (7,), (1000,), (33, 17), (5, 3, 7), (40_001,), (2, 1)]
#: compressor name -> configurations (besides the defaults)
CONFIGS: dict[str, list[dict[str, object]]] = {
    "fp16": [{}], "bf16": [{}],
    "minmax8": [{}, {"chunk_size": 1}, {"chunk_size": 7}],
    "minmax4": [{}, {"chunk_size": 1}, {"chunk_size": 7}],
    "qsgd": [{}, {"levels": 1}, {"levels": 3, "bucket_size": 5}, {"levels": 127}],
    "terngrad": [{}, {"clip": 2.5}],
    "onebit": [{}, {"block": 512}, {"block": 7}], "efsign": [{}, {"block": 512}, {"block": 7}],
    "sign": [{}, {"scaled": True}],
    "topk": [{}, {"density": 0.5}, {"k": 1}, {"approximate": True, "density": 0.003}],
    "randomk": [{}, {"density": 0.3, "rescale": False}, {"k": 1}],
    "threshold": [{}, {"max_density": 0.3, "threshold": 0.5}],
    "powersgd": [{}, {"rank": 1}, {"rank": 4}],
}


def _real_layout(comp: Compressor, shape: tuple[int, ...], dtype: torch.dtype
                 ) -> tuple[list[tuple[tuple[int, ...], torch.dtype]], Payload]:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(*shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
    payload = comp.compress(x, gen)
    return [(tuple(t.shape), t.dtype) for t in payload.tensors], payload


def test_every_registered_compressor_has_a_rule_and_a_tested_config() -> None:
    for name in hc.names():
        assert declares_layout(hc.get(name)), f"{name}: declares no wire_layout"
        assert name in CONFIGS, f"{name}: add its configurations to this test"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layout_equals_the_compressed_payload(name: str) -> None:
    for config in CONFIGS[name]:
        comp = hc.get(name, **config)
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            if name == "fp16" and dtype == torch.float64:
                continue  # fp16 of 3 * randn is in range either way; float64 adds nothing
            for shape in SHAPES:
                if int(config.get("k", 0)) > 1 and shape == (1,):  # type: ignore[call-overload]
                    continue
                want, payload = _real_layout(comp, shape, dtype)
                got = payload_layout(comp, shape, dtype)
                assert got is not None
                assert list(got) == want, (name, config, shape, dtype)
                assert payload_nbytes(comp, shape, dtype) == payload.nbytes


def test_index_dtype_widens_at_2_to_the_31() -> None:
    topk = hc.get("topk", k=5)
    assert payload_layout(topk, (2**31 - 1,))[1] == ((5,), torch.int32)  # type: ignore[index]
    assert payload_layout(topk, (2**31,))[1] == ((5,), torch.int64)  # type: ignore[index]
    # 5 float32 values + 5 int64 indices
    assert payload_nbytes(topk, (2**16, 2**15)) == 5 * 4 + 5 * 8


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="empty tensor"):
        payload_layout(hc.get("fp16"), (3, 0))
    with pytest.raises(TypeError, match="floating-point"):
        payload_layout(hc.get("qsgd"), (8,), torch.int32)
    with pytest.raises(ValueError, match="larger than the tensor"):  # as compress raises
        payload_layout(hc.get("topk", k=9), (8,))


class _Doubling(Compressor):
    """A compressor with no rule: the analytic mode must fall back to compressing it."""

    aggregation = Aggregation.SUM

    def compress(self, tensor: torch.Tensor, generator: torch.Generator | None = None
                 ) -> Payload:
        return Payload((tensor.repeat(2),), tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.tensors[0][: payload.shape.numel()].view(payload.shape)


class _OwnFormat(type(hc.get("fp16"))):  # type: ignore[misc]
    """A subclass that changes the format without declaring it: not sized from the parent's."""

    def compress(self, tensor: torch.Tensor, generator: torch.Generator | None = None
                 ) -> Payload:
        return Payload((tensor.repeat(2),), tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.tensors[0][: payload.shape.numel()].view(payload.shape)


def test_a_subclass_changing_compress_is_not_sized_from_its_parent() -> None:
    assert payload_layout(_OwnFormat(), (6,)) is None
    assert payload_of(_OwnFormat(), (6,)).nbytes == 48


def test_analytic_mode_is_scoped_and_falls_back() -> None:
    qsgd = hc.get("qsgd", levels=5, bucket_size=77)
    with analytic_payloads():
        meta = payload_of(qsgd, (123, 4))
        custom = payload_of(_Doubling(), (6,))
    assert [t.device.type for t in meta.tensors] == ["meta", "meta"]
    assert sizing_times(qsgd) == []  # nothing compressed, nothing timed
    assert custom.tensors[0].device.type == "cpu" and custom.nbytes == 48
    real = payload_of(qsgd, (123, 4))  # outside the block: compressed, and timed
    assert real.tensors[0].device.type == "cpu" and real.nbytes == meta.nbytes
    assert [n for n, _, _ in sizing_times(qsgd)] == [492]
    assert meta_payload(_Doubling(), (6,)) is None
    scalar = meta_payload(qsgd, ())  # 0-d: sized as one element, as payload_of does
    assert scalar is not None and scalar.nbytes == payload_of(qsgd, ()).nbytes


def _layout() -> list[list[TensorSpec]]:
    shapes: list[list[tuple[int, ...]]] = [[(10, 37), (10,)], [(33, 17), (5, 3, 7), (1,)],
                                           [(4097,)], [(64, 64), (2, 1)]]
    return [[TensorSpec(f"t{b}.{i}", s) for i, s in enumerate(bucket)]
            for b, bucket in enumerate(shapes)]


def _gradient_algorithms() -> list[str]:
    return [n for n in registry.names() if n != "auto" and registry.get(n).kind == "grad"]


@pytest.mark.parametrize("label", [*_gradient_algorithms(), "dgc:warmup_steps=8",
                                   "topk:granularity=bucket", "qsgd:error_feedback=true"])
def test_schedules_are_the_same_sized_or_compressed(label: str) -> None:
    algo = make(label)
    for world, hosts in ((2, 1), (3, 3), (8, 2)):
        for step in (0, 3, 10**9):
            real = step_schedule(algo, _layout(), world, step, hosts)
            with analytic_payloads():
                assert step_schedule(algo, _layout(), world, step, hosts) == real, \
                    (label, world, step)


def test_simulate_rows_equal_compressed_sizing() -> None:
    compute = params_compute(120_000, layers=4, samples=8)
    labels = ["fp16", "powersgd", "bytegrad", "qsgd", "signsgd", "topk", "gtopk",
              "randomk", "qadam", "low_precision_decentralized"]
    args = (labels, [8, 32], compute, Cluster(devices_per_host=8, inter="10gbe"), None,
            25.0, None)
    assert simulate(*args) == _simulate(*args, simulable)  # outside the block: compressed
