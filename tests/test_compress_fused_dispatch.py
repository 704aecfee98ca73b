"""The compressors' and the engine guard's dispatch to the fused kernels
(:func:`hexagram.compress.kernels.dispatch`): the same payloads, decoded values, flags and
cleaned buckets as their eager code, bit for bit, with the kernels really called.

Without CUDA the kernels run in Triton's interpreter on CPU tensors, down the device path
(``packing.CPU_FAST_PATHS = False``); each case runs once through the dispatch and once
with it off (``kernels.DISPATCH = False``: the eager code), counting the kernels' calls.
The interpreter must be the process's only Triton mode: if Triton was imported compiled
before this module, one test reruns the file in a fresh process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from _triton_mode import rerun_in_fresh_process, select

import hexagram.compress as hc  # none of these imports triton
from hexagram.compress import kernels, packing
from hexagram.compress.base import SeededCompressor
from hexagram.compress.segments import Segments

CUDA = torch.cuda.is_available()
IN_PROCESS = select("the fused dispatch is")  # the interpreter, chosen before triton is imported

#: the interpreter computes with numpy, which warns where the eager code overflows too
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

DEVICE = torch.device("cuda" if CUDA else "cpu")
SEED = 5
KERNELS = ("minmax_encode", "stochastic_codes", "sign_bits", "decode_table", "decode_affine",
           "finite_clean")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The device path (no CPU fast paths), every kernel wrapped to record its calls."""
    if not IN_PROCESS:
        pytest.skip("triton was imported compiled before this module: see "
                    "test_in_a_fresh_process")
    log: list[str] = []

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kw: Any) -> Any:
            log.append(name)
            return fn(*args, **kw)
        return counted

    for name in KERNELS:
        monkeypatch.setattr(kernels, name, counting(name, getattr(kernels, name)))
    monkeypatch.setattr(packing, "CPU_FAST_PATHS", False)
    monkeypatch.setattr(kernels, "DISPATCH", True)
    yield log


def _both(fn: Callable[[], Any], log: list[str]) -> tuple[Any, Any, list[str]]:
    """(``fn()`` through the dispatch, ``fn()`` eager, the kernels the first one called);
    the eager run must call none."""
    log.clear()
    fused = fn()
    called = list(log)
    kernels.DISPATCH = False
    try:
        eager = fn()
    finally:
        kernels.DISPATCH = True
    assert log == called, f"the eager run called kernels: {log[len(called):]}"
    return fused, eager, called


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtypes, shapes and bits (NaN equal to NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and \
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _x(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Normal values with zeros, -0.0 and a few large ones."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + seed), dtype=torch.float64)
    x[::11] = 0.0
    x[5::13] = -0.0
    x[3::97] *= 1e3
    return x.to(dtype).to(DEVICE)


#: (name, config, the encode kernel, the decode kernel per tensor, in a bucket: None where
#: the bucket's decoder stays eager: one value table per segment)
CASES = [
    ("minmax8", {}, "minmax_encode", "decode_affine", "decode_affine"),
    ("minmax8", {"chunk_size": 100}, "minmax_encode", "decode_affine", "decode_affine"),
    ("minmax4", {}, "minmax_encode", "decode_affine", "decode_affine"),
    ("minmax4", {"chunk_size": 100}, "minmax_encode", "decode_affine", "decode_affine"),
    ("qsgd", {}, "stochastic_codes", "decode_table", "decode_table"),
    ("qsgd", {"levels": 3, "bucket_size": 100}, "stochastic_codes", "decode_affine",
     "decode_affine"),
    ("qsgd", {"levels": 1, "bucket_size": 100}, "stochastic_codes", "decode_table",
     "decode_table"),
    ("terngrad", {}, "stochastic_codes", "decode_table", None),
    ("terngrad", {"clip": 2.5}, "stochastic_codes", "decode_table", None),
    ("sign", {}, "sign_bits", "decode_table", "decode_table"),
    ("sign", {"scaled": True}, "sign_bits", "decode_table", "decode_table"),
    ("efsign", {}, "sign_bits", "decode_table", None),
    ("efsign", {"block": 100}, "sign_bits", "decode_affine", "decode_affine"),
    ("onebit", {}, "sign_bits", "decode_table", None),
    ("onebit", {"block": 100}, "sign_bits", "decode_affine", "decode_affine"),
]
IDS = [f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[1].items()) or 'default'}" for c in CASES]
#: tensors of a bucket: chunks that straddle tensors (padded rows), and whole chunks of 100
#: (the identity layout)
BUCKETS = [[300, 7, 1000, 193], [200, 100, 300]]


def _compress(c: hc.Compressor, fn: Callable[..., hc.Payload], *args: Any) -> hc.Payload:
    """``fn(*args)`` with a generator of a fixed seed for the stochastic formats."""
    if isinstance(c, SeededCompressor):
        return fn(*args, torch.Generator(DEVICE).manual_seed(SEED))
    return fn(*args)


def _round_trip(c: hc.Compressor, x: torch.Tensor, segments: Segments | None
                ) -> list[torch.Tensor]:
    """The payload's tensors, the decoded values and the values added to a base."""
    base = _x(x.numel(), x.dtype, seed=1)
    if segments is None:
        p = _compress(c, c.compress, x)
        decoded = [c.decompress(p), c.decompress_into(p, base.clone(), add=True)]
    else:
        p = _compress(c, c.compress_segments, x, segments)
        decoded = [c.decompress_segments_into(p, torch.empty_like(x)),
                   c.decompress_segments_into(p, base.clone(), add=True)]
    return [*p.tensors, *decoded]


@pytest.mark.parametrize(("name", "config", "encoder", "decoder", "_"), CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_tensor_dispatch_equals_the_eager_code(name: str, config: dict[str, Any],
                                                   encoder: str, decoder: str, _: Any,
                                                   dtype: torch.dtype,
                                                   calls: list[str]) -> None:
    c = hc.get(name, **config)
    if name == "qsgd" and dtype != torch.float32:  # the levels' table only in the norms' dtype
        decoder = "decode_affine"
    fused, eager, called = _both(lambda: _round_trip(c, _x(1500, dtype), None), calls)
    assert encoder in called and decoder in called, called
    assert len(fused) == len(eager)
    assert all(_same(a, b) for a, b in zip(fused, eager))


@pytest.mark.parametrize(("name", "config", "encoder", "_", "decoder"), CASES, ids=IDS)
@pytest.mark.parametrize("lengths", BUCKETS, ids=["padded", "whole-chunks"])
def test_bucket_dispatch_equals_the_eager_code(name: str, config: dict[str, Any], encoder: str,
                                               _: Any, decoder: str | None,
                                               lengths: list[int], calls: list[str]) -> None:
    c, segments = hc.get(name, **config), Segments.of(lengths)
    x = _x(sum(lengths))
    fused, eager, called = _both(lambda: _round_trip(c, x, segments), calls)
    assert encoder in called, called
    if decoder is None:  # per-segment value tables: the eager gather
        assert not {"decode_table", "decode_affine"} & set(called), called
    else:
        assert decoder in called, called
    assert len(fused) == len(eager)
    assert all(_same(a, b) for a, b in zip(fused, eager))


def test_dispatch_takes_only_what_the_kernels_take(calls: list[str]) -> None:
    """A strided input, an empty tensor or a switched-off dispatch keep the eager code."""
    x = _x(64)
    assert kernels.dispatch(x) and not kernels.dispatch(x[::2])
    assert not kernels.dispatch(x[:0])
    kernels.DISPATCH = False
    try:
        assert not kernels.dispatch(x)
    finally:
        kernels.DISPATCH = True
    c = hc.get("sign")
    fused, eager, called = _both(lambda: c.compress(x[::2]).tensors, calls)
    assert called == [] and _same(fused[0], eager[0])


@pytest.fixture
def comm(tmp_path: Path) -> Iterator[Any]:
    """A real one-rank communicator (gloo) in this process."""
    import torch.distributed as dist

    from hexagram.comm.communicator import Communicator

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    c = Communicator(None, timedelta(seconds=60), "test")
    try:
        yield c
    finally:
        c.close()
        dist.destroy_process_group()


def _guard_step(comm: Any, dtype: torch.dtype, sizes: list[int]) -> list[Any]:
    """A bucket with NaN/Inf planted at the end of some tensors, observed: the names
    flagged, the cleaned buffer and the step's check."""
    from hexagram.buckets import build_buckets
    from hexagram.engine.guard import FiniteGuard
    from hexagram.errors import NonFiniteGradientError

    params = [(f"t{i}", torch.nn.Parameter(torch.empty(n, dtype=dtype, device=DEVICE)))
              for i, n in enumerate(sizes)]
    (bucket,) = build_buckets(params, bucket_bytes=1 << 30)
    bucket.flat.copy_(_x(bucket.numel, dtype))
    for entry, value in zip(bucket.entries[1::2], (float("nan"), float("inf"),
                                                   float("-inf"))):
        bucket.flat[entry.offset + entry.numel - 1] = value
    guard = FiniteGuard([bucket], comm)
    guard.observe(bucket)
    names, cleaned = guard.flagged(), bucket.flat.clone()
    guard.agree()
    with pytest.raises(NonFiniteGradientError) as err:
        guard.check_step(step=2, policy="raise")
    return [names, cleaned, str(err.value)]


@pytest.mark.parametrize(("dtype", "sizes"), [
    (torch.float32, [5, 7, 3, 4, 6, 2]), (torch.float16, [1, 3000, 8, 2]),
    (torch.bfloat16, [2] * 9)])
def test_guard_dispatch_equals_the_eager_check(dtype: torch.dtype, sizes: list[int],
                                               calls: list[str], comm: Any) -> None:
    fused, eager, called = _both(lambda: _guard_step(comm, dtype, sizes), calls)
    assert called == ["finite_clean"]
    assert fused[0] == eager[0] == [f"t{i}" for i in range(1, min(len(sizes), 7), 2)]
    assert _same(fused[1], eager[1]) and bool(torch.isfinite(fused[1]).all())
    assert fused[2] == eager[2] and "'t1'" in fused[2]


@pytest.mark.skipif(IN_PROCESS, reason="the kernels run in this process")
def test_in_a_fresh_process() -> None:
    """Triton was imported compiled before this module (another test module): run this
    file in a process of its own, where the interpreter can be chosen first."""
    rerun_in_fresh_process(__file__)
