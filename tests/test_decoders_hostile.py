"""Every decoder is safe on hostile bytes: random, bit-flipped or garbage-tailed payloads of
the right size never raise a torch error (on a GPU: never a device-side assert), and a decode
that is not finite is always flagged by ``payload_fault`` (a 0-d bool, read by the caller
once per step). Valid payloads are never flagged and decode as before, bit for bit.

Property-based (hypothesis): for every registered compressor, per tensor and per bucket
(``compress_segments``), on the CPU's fast paths and down the code CUDA takes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hexagram.compress as hc
from hexagram.compress import packing
from hexagram.compress.base import Compressor, Payload
from hexagram.compress.segments import Segments
from hexagram.errors import HexagramError

NAMES = hc.names()
LENGTHS = (37, 5, 64)  # a bucket of three tensors (one tiny)
SETTINGS = settings(max_examples=10, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@contextmanager
def _fast_paths(on: bool) -> Iterator[None]:
    saved = packing.CPU_FAST_PATHS
    packing.CPU_FAST_PATHS = on
    try:
        yield
    finally:
        packing.CPU_FAST_PATHS = saved


def _compressor(name: str) -> Compressor:
    extra = {"powersgd": {"rank": 2}, "minmax8": {"chunk_size": 16},
             "minmax4": {"chunk_size": 16}, "qsgd": {"bucket_size": 16},
             "topk": {"density": 0.2}, "randomk": {"density": 0.2},
             "threshold": {"threshold": 0.5, "max_density": 0.3}}.get(name, {})
    return hc.get(name, **extra)


def _payload(c: Compressor, segmented: bool, seed: int, device: str) -> tuple[Payload, int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(LENGTHS), generator=g).to(device)
    if segmented:
        return c.compress_segments(x, Segments.of(list(LENGTHS))), x.numel()
    return c.compress(x.view(53, 2) if c.name == "powersgd" else x[:106]), 106


def _decode(c: Compressor, p: Payload, n: int, segmented: bool) -> torch.Tensor:
    out = torch.full((n,), 7.0, device=p.tensors[-1].device)
    if segmented:
        return c.decompress_segments_into(p, out)
    return c.decompress(p).reshape(-1)


def _corrupt(buf: torch.Tensor, how: str, data: st.DataObject) -> torch.Tensor:
    n = buf.numel()
    raw = buf.cpu().clone()
    if how == "random":
        raw = torch.tensor(list(data.draw(st.binary(min_size=n, max_size=n))),
                           dtype=torch.uint8)
        return raw.to(buf.device)
    if how == "tail":  # the right size, a garbage tail after an honest head
        cut = data.draw(st.integers(0, n - 1))
        raw[cut:] = torch.tensor(list(data.draw(st.binary(min_size=n - cut,
                                                          max_size=n - cut))),
                                 dtype=torch.uint8)
        return raw.to(buf.device)
    flips = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 7)),
                               min_size=1, max_size=4))
    for byte, bit in flips:
        raw[byte] ^= 1 << bit
    return raw.to(buf.device)


def _check_hostile(name: str, segmented: bool, fast: bool, device: str,
                   data: st.DataObject) -> None:
    c = _compressor(name)
    with _fast_paths(fast):
        p, n = _payload(c, segmented, data.draw(st.integers(0, 3)), device)
        how = data.draw(st.sampled_from(["random", "tail", "flip"]))
        bad = p.from_buffer(_corrupt(p.to_buffer(), how, data))
        flag = c.payload_fault(bad)
        assert flag.shape == () and flag.dtype == torch.bool and flag.device == p.tensors[
            -1].device
        try:
            out = _decode(c, bad, n, segmented)
        except HexagramError:
            return  # a named error is allowed; a raw torch error is not
        healthy = out.shape == (n,) and bool(torch.isfinite(out).all())
        assert healthy or bool(flag), (
            f"{name} ({'bucket' if segmented else 'tensor'}, {how}): decoded NaN/Inf or a "
            "wrong shape and payload_fault did not flag it")


def _check_valid(name: str, segmented: bool, fast: bool, device: str, seed: int) -> None:
    c = _compressor(name)
    with _fast_paths(fast):
        p, n = _payload(c, segmented, seed, device)
        assert not bool(c.payload_fault(p)), f"{name}: a valid payload was flagged"
        again = p.from_buffer(p.to_buffer())  # what crosses the wire
        assert not bool(c.payload_fault(again))
        a, b = _decode(c, p, n, segmented), _decode(c, again, n, segmented)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("segmented", [False, True], ids=["tensor", "bucket"])
@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(data=st.data(), fast=st.booleans())
def test_hostile_bytes_never_raise_and_bad_results_are_flagged(
        name: str, segmented: bool, fast: bool, data: st.DataObject) -> None:
    _check_hostile(name, segmented, fast, "cpu", data)


@pytest.mark.parametrize("segmented", [False, True], ids=["tensor", "bucket"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("fast", [True, False], ids=["cpu_fast", "device_path"])
def test_valid_payload_is_not_flagged_and_decodes_unchanged(
        name: str, segmented: bool, fast: bool) -> None:
    for seed in range(3):
        _check_valid(name, segmented, fast, "cpu", seed)


@pytest.mark.parametrize("name", ["topk", "randomk", "threshold"])
def test_index_out_of_range_is_clamped_and_flagged(name: str) -> None:
    c = _compressor(name)
    p, n = _payload(c, False, 0, "cpu")
    tensors = list(p.tensors)
    tensors[-1] = torch.full_like(tensors[-1], n + 1000)  # every index past the end
    bad = Payload(tensors=tuple(tensors), shape=p.shape, dtype=p.dtype)
    assert bool(c.payload_fault(bad))
    assert c.decompress(bad).shape == p.shape  # no IndexError


def test_nan_scale_is_flagged() -> None:
    c = _compressor("qsgd")
    p, _ = _payload(c, False, 0, "cpu")
    norms = p.tensors[0].clone()
    norms[1] = float("nan")
    assert bool(c.payload_fault(Payload((norms, p.tensors[1]), p.shape, p.dtype)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("segmented", [False, True], ids=["tensor", "bucket"])
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=6, deadline=None, derandomize=True)
@given(data=st.data())
def test_hostile_bytes_on_cuda_never_assert(name: str, segmented: bool,
                                            data: st.DataObject) -> None:
    _check_hostile(name, segmented, False, "cuda", data)
    torch.cuda.synchronize()  # a device-side assert would surface here
