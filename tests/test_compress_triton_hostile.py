"""The fused Triton decoders on hostile bytes.

For every compressor whose decode the kernels take on a GPU (8-bit and 4-bit min-max, QSGD,
TernGrad, the sign family), payloads of random or bit-flipped bytes (NaN or Inf scales,
any codes) decode in the kernel exactly as in the eager code (NaN where it has NaN), into a
fresh tensor and added to one; nothing raises, and a result that is not finite is flagged
by ``payload_fault``. Without CUDA the kernels run in Triton's interpreter on CPU tensors;
with CUDA (the ``gpu`` tests) they are compiled.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _triton_mode import DEVICES, kernel_device, rerun_in_fresh_process, select, use_decoders

import hexagram.compress as hc

#: the interpreter computes with numpy, which warns where hostile scales overflow
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
IN_PROCESS = select("the fused decoders on hostile bytes are")

DECODED = [("minmax8", {"chunk_size": 64}), ("minmax4", {"chunk_size": 100}),
           ("qsgd", {"levels": 3, "bucket_size": 128}), ("qsgd", {"levels": 127}),
           ("terngrad", {}), ("sign", {"scaled": True}), ("efsign", {"block": 128}),
           ("onebit", {"block": 100})]
N = 1000
SEEDS = range(4)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """The device under test, with the eager code CUDA takes (no CPU fast paths) and the
    compressors' own dispatch off (the tests choose the decoders)."""
    with kernel_device(request.param, IN_PROCESS) as where:
        yield where


def _hostile(payload: hc.Payload, seed: int) -> hc.Payload:
    """Random bytes (even seeds) or a few flipped bits (odd) of the payload's size."""
    buf = payload.to_buffer().cpu()
    gen = torch.Generator().manual_seed(seed)
    if seed % 2 == 0:
        raw = torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8)
    else:
        raw = buf.clone()
        at = torch.randint(0, raw.numel(), (4,), generator=gen)
        bit = torch.randint(0, 8, (4,), generator=gen, dtype=torch.uint8)
        raw[at] ^= torch.ones_like(bit) << bit
    return payload.from_buffer(raw.to(payload.tensors[0].device))


def _decodes(c: hc.Compressor, p: hc.Payload, base: torch.Tensor) -> list[torch.Tensor]:
    return [c.decompress(p).reshape(-1), c.decompress_into(p, base.clone(), add=True)]


@pytest.mark.parametrize(("name", "config"), DECODED,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(DECODED)])
def test_hostile_payloads_decode_as_the_eager_code(name: str, config: dict[str, Any],
                                                   device: torch.device,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    c = hc.get(name, **config)
    x = torch.randn(N, generator=torch.Generator().manual_seed(0)).to(device)
    base = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(device)
    honest = c.compress(x, torch.Generator(device).manual_seed(0)) \
        if name in ("qsgd", "terngrad") else c.compress(x)
    for seed in SEEDS:
        bad, calls = _hostile(honest, seed), list[str]()
        with monkeypatch.context() as m:
            use_decoders(m, True, calls)
            got = _decodes(c, bad, base)
        with monkeypatch.context() as m:
            use_decoders(m, False)
            want = _decodes(c, bad, base)
        assert len(calls) == 2, f"{name}: the kernels decoded {len(calls)} of 2 payloads"
        for a, b in zip(got, want):
            same = torch.equal(a.isnan(), b.isnan()) and torch.equal(
                a.masked_fill(a.isnan(), 0.0), b.masked_fill(b.isnan(), 0.0))
            assert same, f"{name}, seed {seed}: the fused decode differs from the eager one"
        finite = bool(torch.isfinite(got[0]).all())
        assert finite or bool(c.payload_fault(bad)), (
            f"{name}, seed {seed}: the fused decode is not finite and payload_fault did "
            "not flag the payload")


@pytest.mark.skipif(IN_PROCESS, reason="the kernels run in this process")
def test_in_a_fresh_process() -> None:
    """Triton was imported compiled before this module (another test module): run this
    file in a process of its own, where the interpreter can be chosen first."""
    rerun_in_fresh_process(__file__)
