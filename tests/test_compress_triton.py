"""The fused Triton kernels (:mod:`hexagram.compress.kernels`) against the eager code, bit
for bit.

Without CUDA the kernels run in Triton's interpreter on CPU tensors, and the reference is
the eager code CUDA takes, run on the CPU (``packing.CPU_FAST_PATHS = False``). With CUDA
(the ``gpu`` tests) they are compiled and compared with the eager code on the GPU. The
interpreter must be the process's only Triton mode: if Triton was imported compiled
before this module, one test reruns the file in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _triton_mode import DEVICES, ROOT, kernel_device, rerun_in_fresh_process, select, use_decoders

import hexagram.compress as hc
from hexagram.compress import kernels, packing, quantize, ternary
from hexagram.compress.sign_bits import encode_signs

CUDA = torch.cuda.is_available()
IN_PROCESS = select("the fused kernels are")  # the interpreter, chosen before triton is imported

#: the interpreter computes with numpy, which warns where the eager code overflows too
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

SIZES = [1, 7, 8, 1023, 4097]
SEED = 3


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """The device under test; the eager reference takes the path CUDA takes, without the
    compressors' own dispatch to the kernels (these tests call the kernels themselves)."""
    with kernel_device(request.param, IN_PROCESS) as where:
        yield where


def _x(n: int, device: torch.device, dtype: torch.dtype = torch.float32,
       shift: float = 0.0) -> torch.Tensor:
    """Normal values with zeros, -0.0 and a few large ones."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    x[::11] = 0.0
    x[5::13] = -0.0
    x[3::97] *= 1e3
    return (x + shift).to(dtype).to(device)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, dtypes and shapes (-0.0 equals 0.0, as ``torch.equal`` has it)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("n", SIZES)
def test_sign_bits_equal_the_eager_bits(n: int, device: torch.device) -> None:
    x = _x(n, device)
    x[-1:] = float("nan") if n > 1 else x[-1:]
    want, _ = encode_signs(x, "sign", stats=False, check=False)
    assert _same(kernels.sign_bits(x), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_sign_bits_of_other_dtypes(dtype: torch.dtype, device: torch.device) -> None:
    x = _x(1025, device, dtype)
    x[:4] = torch.tensor([float("inf"), float("-inf"), -0.0, float("nan")])
    assert _same(kernels.sign_bits(x), encode_signs(x, "sign", stats=False, check=False)[0])


MINMAX = [("minmax8", 1024), ("minmax4", 128), ("minmax8", 7), ("minmax4", 3000)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("name", "chunk"), MINMAX)
def test_minmax_encode_equals_the_eager_payload(n: int, name: str, chunk: int,
                                                device: torch.device) -> None:
    for shift in (0.0, 7.0):  # chunks straddling 0 and chunks that do not
        x = _x(n, device, shift=shift)
        want = hc.get(name, chunk_size=chunk).compress(x).tensors
        bits = 8 if name == "minmax8" else 4
        got = kernels.minmax_encode(x, chunk, bits)
        assert _same(got[0], want[0]) and _same(got[1], want[1])


def _special(device: torch.device, big: float = 3.0e38) -> torch.Tensor:
    """Chunks of 8: constant, all zero, a range beyond float32 (halves; ``big`` 0: none),
    subnormal steps and norms, one element."""
    tiny = 1.0e-44
    rows = [[2.5] * 8, [0.0] * 8, [big, -big, 1.0, 0.0, -1.0, big / 3, -big / 7, 5.0],
            [tiny, 0.0, -tiny, tiny / 2, 0.0, tiny, 0.0, -tiny / 3], [1e-30] * 7 + [2e-30],
            [7.0]]
    return torch.tensor([v for r in rows for v in r], dtype=torch.float32).to(device)


@pytest.mark.parametrize("bits", [8, 4])
def test_minmax_encode_of_edge_chunks(bits: int, device: torch.device) -> None:
    x = _special(device)
    want = hc.get(f"minmax{bits}", chunk_size=8).compress(x).tensors
    got = kernels.minmax_encode(x, 8, bits)
    assert _same(got[0], want[0]) and _same(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_minmax_encode_of_other_dtypes(dtype: torch.dtype, device: torch.device) -> None:
    x = _x(2050, device, dtype)
    want = hc.get("minmax8", chunk_size=512).compress(x).tensors
    got = kernels.minmax_encode(x, 512, 8)
    assert _same(got[0], want[0]) and _same(got[1], want[1])


def test_minmax_encode_divides_as_torch_does_on_each_device(device: torch.device) -> None:
    """CUDA's torch divides by a Python number as a multiplication by its reciprocal:
    ``recip=True`` gives that step, ``False`` the true quotient; codes follow each step."""
    x = _x(4097, device)
    lo, hi = x.view(-1, 17).amin(1), x.view(-1, 17).amax(1)  # 4097 = 241 * 17
    span = hi / 2 - lo / 2
    for recip, step in ((True, span * (torch.ones(1) / 127.5).to(device)),
                        (False, torch.div(span, torch.full_like(span, 127.5)))):
        header, codes = kernels.minmax_encode(x, 17, 8, recip=recip)
        assert _same(header, torch.stack([lo, step], 1))
        inv = torch.where(step > 0, 1 / step, 0.0)
        inv = torch.where(torch.isfinite(inv), inv, 0.0)
        assert _same(codes, quantize._minmax_codes_device(x, 17, lo, hi, inv, 8))


@pytest.fixture
def fused_draws(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The quantizers' stochastic rounding replaced by the kernel, as the compressors will
    call it; returns the list of the kernel's calls (its input sizes)."""
    calls: list[int] = []

    def fused(flat: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        calls.append(flat.numel())
        return kernels.stochastic_codes(flat, *args, **kw)

    monkeypatch.setattr(quantize, "stochastic_codes", fused)
    monkeypatch.setattr(ternary, "stochastic_codes", fused)
    return calls


def _stochastic_pair(name: str, x: torch.Tensor, patch: pytest.MonkeyPatch,
                     config: dict[str, Any]) -> tuple[tuple[torch.Tensor, ...], ...]:
    """(eager payload, fused payload) of ``name`` with generators of the same seed."""
    c = hc.get(name, **config)
    with patch.context() as m:
        m.setattr(quantize, "stochastic_codes", _EAGER_CODES)
        m.setattr(ternary, "stochastic_codes", _EAGER_CODES)
        want = c.compress(x, torch.Generator(x.device).manual_seed(SEED)).tensors
    return want, c.compress(x, torch.Generator(x.device).manual_seed(SEED)).tensors


_EAGER_CODES = quantize.stochastic_codes


@pytest.mark.parametrize("levels", [1, 3, 7, 127])  # 2, 3, 4 and 8 bits
@pytest.mark.parametrize("n", [7, 4097])
def test_qsgd_codes_equal_the_eager_codes(levels: int, n: int, device: torch.device,
                                          fused_draws: list[int],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    x = _x(n, device)
    want, got = _stochastic_pair("qsgd", x, monkeypatch, {"levels": levels,
                                                          "bucket_size": 500})
    assert fused_draws == [n]
    assert all(_same(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize(("n", "dtype", "clip"), [(1, torch.float32, 0.0),
                                                  (1023, torch.float32, 2.5),
                                                  (4097, torch.float16, 0.0),
                                                  (300, torch.float64, 0.0)])
def test_terngrad_codes_equal_the_eager_codes(n: int, dtype: torch.dtype, clip: float,
                                              device: torch.device, fused_draws: list[int],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    x = _x(n, device, dtype)
    want, got = _stochastic_pair("terngrad", x, monkeypatch, {"clip": clip})
    assert fused_draws == [n]
    assert all(_same(a, b) for a, b in zip(got, want))


def test_terngrad_codes_on_rounding_boundaries(device: torch.device, fused_draws: list[int],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs built from the dither the generator will draw so that every element lands
    exactly on a rounding boundary, where the ``2**-17`` shift decides the code."""
    n = 4097
    r = kernels.draw_dither(torch.Generator(device).manual_seed(SEED), n, device).double()
    x = -0.5 - 2.0**-17 - r / 2**16  # x + 1.5 + 2**-17 + r / 2**16 == 1 exactly
    x = torch.where(x < -1, x + 1, x)
    x[0] = 1.0  # max |x| = 1: scale 1, every product exact
    want, got = _stochastic_pair("terngrad", x.float(), monkeypatch, {})
    assert fused_draws == [n] and all(_same(a, b) for a, b in zip(got, want))
    codes = packing.unpack_codes(got[1], 2, n)[1:]
    assert bool(((codes == 1) | (codes == 2)).all())  # never 0 or 1 below the boundary


def test_qsgd_codes_of_tiny_norms_take_the_pre_scale(device: torch.device,
                                                     fused_draws: list[int],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Norms below 1e-38 make s / norm overflow float32: x * 2**64 first (``pre``)."""
    x = _special(device, big=0.0)
    want, got = _stochastic_pair("qsgd", x, monkeypatch, {"bucket_size": 8})
    assert fused_draws and all(_same(a, b) for a, b in zip(got, want))


@pytest.fixture
def fused_decoders(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The decoders replaced by the kernels wherever the compressors call them; returns the
    list of the kernels' calls."""
    calls: list[str] = []
    use_decoders(monkeypatch, True, calls)
    return calls


DECODED = [("minmax8", {}), ("minmax4", {"chunk_size": 100}), ("qsgd", {"levels": 1}),
           ("qsgd", {"levels": 3}), ("qsgd", {"levels": 7, "bucket_size": 300}),
           ("qsgd", {"levels": 127}), ("terngrad", {}), ("sign", {}),
           ("sign", {"scaled": True}), ("efsign", {}), ("onebit", {}),
           ("efsign", {"block": 256}), ("onebit", {"block": 100})]


def _decode_both(c: hc.Compressor, payload: hc.Payload, base: torch.Tensor,
                 patch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(fused, eager) decodes of ``payload``: into a fresh tensor, and added to ``base``."""
    got = [c.decompress(payload), c.decompress_into(payload, base.clone(), add=True)]
    with patch.context() as m:  # the eager decoders back in place
        use_decoders(m, False)
        want = [c.decompress(payload), c.decompress_into(payload, base.clone(), add=True)]
    return got, want


@pytest.mark.parametrize(("name", "config"), DECODED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decoders_equal_the_eager_decoders(name: str, config: dict[str, Any],
                                           dtype: torch.dtype, device: torch.device,
                                           fused_decoders: list[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every payload decodes to the same bits, into a fresh tensor and added to one."""
    x = _x(4097, device, dtype)
    c = hc.get(name, **config)
    payload = c.compress(x, torch.Generator(device).manual_seed(SEED)) \
        if name in ("qsgd", "terngrad") else c.compress(x)
    got, want = _decode_both(c, payload, _x(4097, device, dtype, shift=1.0), monkeypatch)
    assert len(fused_decoders) == 2
    assert all(_same(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("name", ["minmax8", "minmax4", "efsign", "onebit"])
def test_decoders_of_edge_chunks(name: str, device: torch.device, fused_decoders: list[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks whose values overflow float32 mid-way decode in halves (``post``); subnormal
    and constant chunks."""
    x = _special(device, big=0.0 if name == "onebit" else 3.0e38)
    c = hc.get(name, **({"chunk_size": 8} if name.startswith("minmax") else {"block": 8}))
    got, want = _decode_both(c, c.compress(x), _special(device, big=0.0), monkeypatch)
    assert len(fused_decoders) == 2
    assert all(_same(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("name", ["minmax8", "minmax4", "qsgd", "terngrad", "sign"])
def test_a_large_bucket_on_cuda(name: str, device: torch.device, fused_draws: list[int],
                                fused_decoders: list[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Four million elements and three (many programs, grids beyond one wave) encode and
    decode to the eager bits; CUDA only (the interpreter would take minutes)."""
    if device.type != "cuda":
        pytest.skip("a large bucket in the interpreter is too slow; the gpu tier runs it")
    x = _x((1 << 22) + 3, device)
    c = hc.get(name)
    if name in ("qsgd", "terngrad"):
        want, got = _stochastic_pair(name, x, monkeypatch, {})
        payload = c.compress(x, torch.Generator(device).manual_seed(SEED))
    else:
        payload = c.compress(x)
        want = payload.tensors
        got = kernels.minmax_encode(x, c.config.chunk_size, c.bits) \
            if name.startswith("minmax") else (kernels.sign_bits(x),)
    assert all(_same(a, b) for a, b in zip(got, want))
    got_d, want_d = _decode_both(c, payload, _x((1 << 22) + 3, device, shift=1.0), monkeypatch)
    assert all(_same(a, b) for a, b in zip(got_d, want_d))


def test_minmax_header_is_a_finiteness_probe(device: torch.device) -> None:
    """NaN or Inf in a chunk make its header row non-finite (the compressor's cheap check);
    the other chunks keep the eager bits."""
    x = _x(1000, device)
    x[[10, 450, 999]] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    header, _ = kernels.minmax_encode(x, 100, 8)
    bad = ~torch.isfinite(header).all(1)
    assert bad.nonzero().flatten().tolist() == [0, 4, 9]
    c = hc.get("minmax8", chunk_size=100)
    c.checks_finite = False
    assert _same(header[~bad], c.compress(x).tensors[0][~bad])


def _bucket(lengths: list[int], device: torch.device, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A bucket of segments with NaN/Inf in some, and its segment starts."""
    x = _x(sum(lengths), device, dtype)
    x[7::13] = x[7::13] * 1e-40 if dtype == torch.float32 else x[7::13]  # subnormals kept
    starts = torch.tensor([0, *lengths[:-1]], device=device).cumsum(0)
    # the first element of one segment, the last of another, the middle of the last one
    for k, at, value in ((1, 0, float("nan")), (3, lengths[min(3, len(lengths) - 1)] - 1,
                                                float("inf")),
                         (len(lengths) - 1, lengths[-1] // 2, float("-inf"))):
        if k < len(lengths):
            x[int(starts[k]) + at] = value
    return x, starts


@pytest.mark.parametrize(("lengths", "dtype"), [
    ([1], torch.float32), ([8], torch.float32), ([4097], torch.float16),
    ([1, 7, 8, 1023, 4097, 3], torch.float32), ([3] * 300 + [1500], torch.bfloat16),
    ([2] * 5, torch.float64)])
def test_finite_clean_flags_segments_and_zeroes_only_non_finite(
        lengths: list[int], dtype: torch.dtype, device: torch.device) -> None:
    x, starts = _bucket(lengths, device, dtype)
    views = list(torch.split(x, lengths))
    want_bad = torch.stack([~torch.isfinite(v).all() for v in views])
    want = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    got = x.clone()
    bad = kernels.finite_clean(got, starts)
    assert _same(bad, want_bad)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # -0.0 kept too


def test_finite_clean_writes_into_given_flags(device: torch.device) -> None:
    x, starts = _bucket([5, 6, 7, 8], device, torch.float32)
    flags = torch.ones(4, dtype=torch.bool, device=device)
    assert kernels.finite_clean(x, starts, out=flags) is flags
    assert flags.tolist() == [False, True, False, True]


def test_bad_arguments_name_the_problem(device: torch.device) -> None:
    x = _x(16, device)
    cases = [
        (lambda: kernels.sign_bits(x.view(4, 4)), "1-D contiguous"),
        (lambda: kernels.sign_bits(x[::2]), "1-D contiguous"),
        (lambda: kernels.minmax_encode(x, 0, 8), "positive int"),
        (lambda: kernels.minmax_encode(x, 8, 2), "bits must be 4 or 8"),
        (lambda: kernels.decode_affine(torch.zeros(3, dtype=torch.uint8, device=device), 8, 4,
                                       4, x[:1], None, torch.float32), "take 4"),
        (lambda: kernels.decode_table(torch.zeros(2, dtype=torch.uint8, device=device), 1, 16,
                                      x[:1], torch.empty(16, device=device)), "2 values"),
        (lambda: kernels.finite_clean(x, torch.zeros(2, dtype=torch.int32, device=device)),
         "int64"),
        (lambda: kernels.stochastic_codes(x, 4, x[:2], 1, torch.Generator(device)),
         "4 chunks need"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words):
            call()


def test_availability_follows_the_devices(device: torch.device) -> None:
    x = torch.ones(3, device=device)
    assert kernels.available(x) and not kernels.available()
    if CUDA:
        assert not kernels.available(x, torch.ones(3))


def test_importing_hexagram_never_imports_triton() -> None:
    """``import hexagram`` (and the kernels package) leaves Triton unimported; with Triton
    hidden, the kernels are unavailable and say so."""
    code = ("import sys, torch, hexagram, hexagram.compress.kernels as k\n"
            "assert 'triton' not in sys.modules, 'triton imported eagerly'\n"
            "sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            "x = torch.ones(3, device='cuda' if torch.cuda.is_available() else 'cpu')\n"
            "assert not k.available(x)\n"
            "try:\n    k.sign_bits(x)\nexcept k.KernelUnavailable as e:\n    print('ok', e)\n")
    done = _fresh_python(code)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a new interpreter, Triton not in interpreter mode, this tree first."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600)


def test_compiled_kernels_round_as_torch() -> None:
    """Compiled for an H200 (no GPU needed): no fused multiply-add, divisions exact (never
    float32's approximate ``div.full``), no flush of subnormals: what the interpreter's
    numpy cannot show."""
    done = _fresh_python("import json; from hexagram.compress.kernels.ptx import audit; "
                         "print(json.dumps(audit()))")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert len(report) == 7 and report["minmax_header"]["div.rn"] > 0
    for counts in report.values():
        assert counts["fma"] == counts["div.full"] == counts["div.approx"] == counts["ftz"] == 0


@pytest.mark.skipif(IN_PROCESS, reason="the kernels run in this process")
def test_in_a_fresh_process() -> None:
    """Triton was imported compiled before this module (another test module): run this
    file in a process of its own, where the interpreter can be chosen first."""
    rerun_in_fresh_process(__file__)
