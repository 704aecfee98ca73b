"""Byte-level attacks (:mod:`hexagram.testing.byte_attacks`): payloads corrupted on the wire.

The wrapper itself (single process): each attack really corrupts the bytes it names, keeps
every shape and dtype (the wire size is unchanged) and leaves the decoders alone. Through
training (gloo): the last rank attacks through :class:`~hexagram.testing.attacks.
AttackConfig`; without ``robust`` every rank raises the same named error at the first
step (bad indices: the decoders' malformed-payload check, naming the sender), with
``robust`` training goes on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hexagram.compress as hc
from hexagram.compress.segments import Segments
from hexagram.launch import run_local
from hexagram.testing.attacks import ATTACKS, AttackConfig, corrupt
from hexagram.testing.byte_attacks import (
    BYTE_ATTACKS,
    CorruptingCompressor,
    corrupt_payload,
)

COMPRESSORS: dict[str, dict[str, Any]] = {"fp16": {}, "topk": {"density": 0.1}, "qsgd": {},
                                          "minmax8": {}, "efsign": {}}


def _payload(name: str) -> Any:
    return hc.get(name, **COMPRESSORS[name]).compress(torch.randn(1000,
                                                      generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("attack", BYTE_ATTACKS)
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_layout_and_wire_size_are_unchanged(name: str, attack: str) -> None:
    p = _payload(name)
    bad = corrupt_payload(attack, p, torch.Generator().manual_seed(1))
    assert bad.nbytes == p.nbytes
    assert [(t.shape, t.dtype) for t in bad.tensors] == [(t.shape, t.dtype) for t in p.tensors]
    assert bad.to_buffer().numel() == p.to_buffer().numel()


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_malformed_replaces_the_bytes(name: str) -> None:
    p = _payload(name)
    raw, bad = p.to_buffer(), corrupt_payload("malformed", p,
                                              torch.Generator().manual_seed(1)).to_buffer()
    # random bytes: about 1 in 256 equal by chance, never most of them
    assert (raw == bad).float().mean() < 0.05


def test_index_out_of_range_sets_every_index_past_the_end() -> None:
    p = _payload("topk")
    bad = corrupt_payload("index_out_of_range", p, torch.Generator().manual_seed(1))
    ints = [(a, b) for a, b in zip(p.tensors, bad.tensors) if not a.is_floating_point()]
    assert ints, "top-k sends its indices"
    for before, after in ints:
        assert int(before.max()) < 1000 and int(after.min()) >= 1000
    floats = [(a, b) for a, b in zip(p.tensors, bad.tensors) if a.is_floating_point()]
    assert all(torch.equal(a, b) for a, b in floats)  # the values are left alone


@pytest.mark.parametrize("name", ["qsgd", "minmax8", "efsign", "topk", "fp16"])
def test_nan_scale_sets_the_scales_and_nothing_else(name: str) -> None:
    p = _payload(name)
    bad = corrupt_payload("nan_scale", p)
    floats = [i for i, t in enumerate(p.tensors) if t.is_floating_point()]
    nan = [i for i, t in enumerate(bad.tensors) if t.is_floating_point() and t.isnan().all()]
    assert nan and set(nan) <= set(floats)
    for i, (a, b) in enumerate(zip(p.tensors, bad.tensors)):
        if i not in nan:
            assert torch.equal(a, b)
    decoded = hc.get(name, **COMPRESSORS[name]).decompress(bad)
    assert not torch.isfinite(decoded).all()


def test_wrapper_corrupts_every_encode_and_decodes_as_its_inner() -> None:
    inner = hc.get("qsgd")
    c = CorruptingCompressor(inner, "nan_scale", seed=3)
    x = torch.randn(300)
    good = inner.compress(x, torch.Generator().manual_seed(0))
    bad = c.compress(x, torch.Generator().manual_seed(0))
    assert bad.nbytes == good.nbytes and c.calls == 1
    assert torch.equal(c.decompress(good), inner.decompress(good))
    seg = Segments.of([100, 200])
    bad_seg = c.compress_segments(x, seg)
    assert c.calls == 2 and any(t.isnan().any() for t in bad_seg.tensors)
    assert c.aggregation is inner.aggregation and c.name == inner.name


def test_byte_attacks_are_attacks_and_corrupt_raw_vectors() -> None:
    assert set(BYTE_ATTACKS) <= set(ATTACKS)
    AttackConfig(name="malformed", ranks=(1,))
    v = torch.randn(64)
    assert torch.isnan(corrupt("nan_scale", v)).all()
    assert torch.equal(corrupt("index_out_of_range", v), v)  # no index in a dense vector
    assert not torch.equal(corrupt("malformed", v, generator=torch.Generator()), v)


# -- through training -------------------------------------------------------------------
def _train(name: str, config: dict[str, Any], attack: str, steps: int) -> dict[str, Any]:
    import hexagram as hx
    from hexagram.testing.attacks import AttackedAlgorithm

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 40), nn.Tanh(), nn.Linear(40, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    world = hx.get_runtime().world_size
    algo = AttackedAlgorithm(hx.algorithms.get(name, **config),
                             AttackConfig(name=attack, ranks=(world - 1,)))
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)
    gen = torch.Generator().manual_seed(hx.get_runtime().rank)
    out: dict[str, Any] = {"error": None, "steps": 0}
    try:
        for step in range(steps):
            model(torch.randn(8, 20, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            out["steps"] = step + 1
    except Exception as exc:  # the kind is the result: named error, or a decoder's raw one
        out["error"] = (out["steps"], type(exc).__name__, str(exc)[:300])
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    out["params"] = [p.detach().clone() for p in net.parameters()]
    model.close()
    return out


PLAIN = {f"{a}/{n}": (n, c, a) for a in BYTE_ATTACKS
         for n, c in (("topk", {"density": 0.1}), ("fp16", {}), ("qsgd", {}))}
ROBUST = {f"{a}/robust": ("robust", {"aggregator": "median", "f": 1, "compressor": "minmax8"},
                          a) for a in ("malformed", "nan_scale")}
ROBUST["malformed/robust-fp32"] = ("robust", {"aggregator": "trimmed_mean", "f": 1},
                                   "malformed")


def _worker(cases: dict[str, tuple[str, dict[str, Any], str]]) -> dict[str, Any]:
    import hexagram as hx

    hx.init()
    return {k: _train(n, c, a, steps=3) for k, (n, c, a) in cases.items()}


@pytest.fixture(scope="module")
def plain() -> list[dict[str, Any]]:
    return run_local(_worker, 2, args=(PLAIN,), timeout=240)


@pytest.fixture(scope="module")
def robust() -> list[dict[str, Any]]:
    return run_local(_worker, 3, args=(ROBUST,), timeout=240)


def _named_error_everywhere(runs: list[dict[str, Any]], key: str) -> None:
    errors = [r[key]["error"] for r in runs]
    assert all(e is not None for e in errors), errors
    # the same step and error everywhere; random bytes may decode finite for a step
    assert len({e[:2] for e in errors}) == 1, errors
    assert errors[0][1] in ("NonFiniteGradientError", "MalformedPayloadError"), errors
    assert errors[0][0] == 0 or "malformed" in key, errors
    assert all(r[key]["finite"] for r in runs)


# a malformed top-k payload holds random indices too: the decoders' check flags them (the
# message names the sender) where a decoder without it would raise IndexError
_BAD_INDICES = {"index_out_of_range/topk", "malformed/topk"}


@pytest.mark.parametrize("key", [k for k in PLAIN if k not in _BAD_INDICES
                                 and not k.startswith("index_out_of_range")])
def test_without_robust_every_rank_raises_the_named_error(
        key: str, plain: list[dict[str, Any]]) -> None:
    _named_error_everywhere(plain, key)
    # the message too: the same sender and the same tensor of the message on every rank
    # (qsgd's scatter-gather named the first tensor each rank's own checks flagged)
    assert plain[0][key]["error"] == plain[1][key]["error"]


@pytest.mark.parametrize("key", sorted(_BAD_INDICES))
def test_bad_indices_raise_the_named_error_on_every_rank(
        key: str, plain: list[dict[str, Any]]) -> None:
    _named_error_everywhere(plain, key)
    for r in plain:  # the decoders' check names the sender, the last rank
        assert r[key]["error"][1] == "MalformedPayloadError", r[key]["error"]
        assert "rank 1 sent" in r[key]["error"][2], r[key]["error"]


@pytest.mark.parametrize("key", ["index_out_of_range/fp16", "index_out_of_range/qsgd"])
def test_index_attack_leaves_formats_without_indices_alone(
        key: str, plain: list[dict[str, Any]]) -> None:
    for r in plain:
        assert r[key]["error"] is None and r[key]["steps"] == 3 and r[key]["finite"]


@pytest.mark.parametrize("key", list(ROBUST))
def test_robust_trains_on(key: str, robust: list[dict[str, Any]]) -> None:
    for r in robust:
        assert r[key]["error"] is None, r[key]["error"]
        assert r[key]["steps"] == 3 and r[key]["finite"]
    for pa, pb in zip(robust[0][key]["params"], robust[1][key]["params"]):
        assert torch.equal(pa, pb)


def test_the_attacker_decodes_its_own_payload_as_it_was() -> None:
    # error feedback decodes the payload it just encoded: the attacker's residual must not
    # meet its own corrupted indices (it would raise there, alone, and hang its peers)
    inner = hc.get("topk", density=0.1)
    c = CorruptingCompressor(inner, "index_out_of_range", keep_own=True)
    x = torch.randn(200)
    sent = c.compress(x)
    assert torch.equal(c.decompress(sent), inner.decompress(inner.compress(x)))
    copy = sent.from_buffer(sent.to_buffer())  # what a peer receives: decoded as it is
    assert int(next(t for t in copy.tensors if not t.is_floating_point()).min()) >= 200
