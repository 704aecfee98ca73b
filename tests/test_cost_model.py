"""The step-time model's arithmetic against hand-computed cases (single process)."""

from __future__ import annotations

import pytest
import torch

import hexagram as hx
from hexagram.buckets import build_buckets
from hexagram.cost.model import MB, amortized, bucket_layout, predict
from hexagram.cost.probe import COLLECTIVES, Fit, NetworkProfile, fit_line
from hexagram.cost.profile import CompressorCost, ComputeProfile
from hexagram.cost.schedule import TensorSpec, payload_of


def net(world: int = 4, latency: float = 0.001, rate: float = 1e7, **rates: float
        ) -> NetworkProfile:
    fits = {k: Fit(latency, rates.get(k, rate)) for k in COLLECTIVES}
    return NetworkProfile(world, world, fits)


def compute(sizes: list[int], ready: list[float], fwd: float = 0.01, upd: float = 0.002
            ) -> ComputeProfile:
    specs = [TensorSpec(f"t{i}", (n,)) for i, n in enumerate(sizes)]
    return ComputeProfile(fwd, max(ready), upd, specs, ready)


def test_fit_line_recovers_latency_and_rate() -> None:
    pts = [(x, 0.002 + x / 5e6) for x in (1e4, 1e5, 1e6)]
    f = fit_line(pts)
    assert f.latency_s == pytest.approx(0.002)
    assert f.rate_bps == pytest.approx(5e6)
    assert fit_line([(1.0, 0.5), (2.0, 0.4)]).rate_bps == 1e12  # noise: no negative rate


def test_overlap_two_buckets_by_hand() -> None:
    # 4 ranks; bucket 0 = 1.5 MB ready at 20 ms, bucket 1 = 2 MB ready at 50 ms.
    # ring bytes: 2*3/4*n. bucket 0: 1 ms + 2.25e6/1e7 = 226 ms, from 20 ms -> 246 ms;
    # bucket 1 starts at 246 ms: 1 ms + 3e6/1e7 = 301 ms -> 547 ms. Step = 10 + 547 + 2 ms.
    c = compute([375_000, 500_000], [0.020, 0.050])
    p = predict(hx.algorithms.get("allreduce"), c, net(), bucket_bytes=MB,
                first_bucket_bytes=MB)
    assert [len(b) for b in p.schedule] == [1, 1]
    assert p.wire_bytes == 2_250_000 + 3_000_000
    assert p.step_s == pytest.approx(0.010 + 0.547 + 0.002)
    assert p.compute_s == pytest.approx(0.062)
    assert p.exposed_s == pytest.approx(p.step_s - p.compute_s)
    assert p.compress_s == 0.0


def test_communication_hidden_behind_backward() -> None:
    # a tiny first bucket early, then backward goes on for 1 s: nothing exposed
    c = compute([1000, 300_000], [0.001, 1.0])
    p = predict(hx.algorithms.get("allreduce"), c, net(rate=1e9), bucket_bytes=4000,
                first_bucket_bytes=4000)
    last = 0.001 + 2 * 3 * 1_200_000 // 4 / 1e9
    assert p.step_s == pytest.approx(0.010 + 1.0 + last + 0.002)


def test_compression_cpu_on_the_critical_path() -> None:
    # top-k (gather, layer-wise): encode a + b n per tensor delays backward; decode P times
    algo = hx.algorithms.get("topk", density=0.01)
    cost = CompressorCost(compress=(0.001, 1e-8), decompress=(0.0005, 2e-9))
    c = compute([1_000_000], [0.1])
    p = predict(algo, c, net(world=4, rate=1e7), cost)
    enc = 0.001 + 1e-8 * 1_000_000
    dec = 4 * (0.0005 + 2e-9 * 1_000_000)
    payload = payload_of(algo.compressor, (1_000_000,)).nbytes  # type: ignore[attr-defined]
    wire = 3 * payload
    assert p.wire_bytes == wire
    assert p.compress_s == pytest.approx(enc + dec)
    assert p.step_s == pytest.approx(0.010 + 0.1 + enc + 0.001 + wire / 1e7 + dec + 0.002)


def test_collective_rates_differ() -> None:
    # bytegrad: all-to-all then allgather, each with its own fit (several flows per port)
    algo = hx.algorithms.get("bytegrad")
    c = compute([400_000], [0.0], fwd=0.0, upd=0.0)
    slow = predict(algo, c, net(rate=1e7, alltoall=5e6))
    fast = predict(algo, c, net(rate=1e7))
    (a2a, ag), = slow.schedule
    assert (a2a.op, ag.op) == ("alltoall", "allgather")
    assert slow.step_s - fast.step_s == pytest.approx(a2a.sent / 5e6 - a2a.sent / 1e7)


def test_bucket_layout_matches_the_engine() -> None:
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n)))
              for i, n in enumerate([10, 300_000, 50, 700_000, 20, 5])]
    c = ComputeProfile(0.0, 1.0, 0.0, [TensorSpec(n, tuple(p.shape)) for n, p in params],
                       [0.1 * i for i in range(len(params))])
    for cap, first in ((MB, MB // 4), (4 * MB, MB), (0, 0), (100 * MB, MB)):
        engine = [[e.name for e in b.entries] for b in build_buckets(params, cap, min(first, cap))]
        ours = [[s.name for s in specs] for specs, _ in bucket_layout(c, cap, first)]
        assert ours == engine, (cap, first)


def test_weight_algorithm_amortized() -> None:
    # local SGD, period 8: one ring allreduce of the weights every 8 steps
    algo = hx.algorithms.get("local_sgd", period=8)
    c = compute([1_000_000], [0.05])
    p = amortized(algo, c, net(world=4, rate=1e7))
    ring = 2 * 3 * 4_000_000 // 4
    assert p.wire_bytes == ring // 8
    assert p.step_s == pytest.approx(c.step_s + (0.001 + ring / 1e7) / 8)


def test_profile_round_trip(tmp_path: object) -> None:
    n = net()
    n.notes.append("x")
    again = NetworkProfile.from_json(n.to_json())
    assert again == n
    c = compute([3, 4], [0.1, 0.2])
    assert ComputeProfile.from_json(c.to_json()) == c


def test_hierarchical_bytes_by_hand() -> None:
    # 4 ranks on 2 hosts: a leader receives its peer's reduce (sends nothing there),
    # allreduces among 2 leaders (ring: n) and broadcasts n: (2-1) n + n; the other sends n
    from hexagram.cost.schedule import wire_bytes

    algo = hx.algorithms.get("allreduce", hierarchical=True)
    layout = [[TensorSpec("w", (1000,))]]
    assert wire_bytes(algo, layout, world=4, hosts=2, rank=0) == 4000 + 4000
    assert wire_bytes(algo, layout, world=4, hosts=2, rank=1) == 4000
    assert wire_bytes(algo, layout, world=4, hosts=4, rank=1) == 2 * 3 * 4000 // 4


def test_cpu_floor_where_ranks_share_cores_by_hand() -> None:
    """One 1 MB bucket ready at 10 ms, 4 ranks, 2 per core, compute 22 ms wall and 22 ms
    CPU -> in lockstep 44 ms (every time x2: fwd 20, ready 20, backward 20, update 4 ms).
    Slow link (1e7 B/s): chain = 20 + (20 + 1 + 1.5e6 / 1e7 * 1000) + 4 = 195 ms; floor =
    2 * (22 + 1 + 1.5) = 49 ms -> 195 ms. Fast link (1e12 B/s): chain = 20 + 21 + 4 = 45 ms
    < floor 49 ms. Not shared, or CPU unmeasured: the measured compute, the chain alone."""
    c = compute([250_000], [0.010])
    c.cpu_s = 0.022
    shared = net()
    shared.cpu, shared.share = {"allreduce": Fit(0.001, 1e9)}, 2.0
    allreduce = hx.algorithms.get("allreduce")
    p = predict(allreduce, c, shared)
    assert p.compute_s == pytest.approx(0.044) and p.cpu_floor_s == pytest.approx(0.049)
    assert p.step_s == pytest.approx(0.195)
    fast = net(rate=1e12)
    fast.cpu, fast.share = shared.cpu, 2.0
    assert predict(allreduce, c, fast).step_s == pytest.approx(0.049)
    shared.share = 1.0
    assert predict(allreduce, c, shared).step_s == pytest.approx(0.173)
    shared.share, c.cpu_s = 2.0, None
    assert predict(allreduce, c, shared).step_s == pytest.approx(0.173)


def test_compression_cpu_is_paid_share_times() -> None:
    """Compressor costs are CPU seconds (timed on the thread's clock): where 2 ranks share a
    core they compress at the same moments, so the step pays compression twice, in the
    chain and in the CPU floor, like compute (fast link: the floor decides)."""
    c = compute([250_000], [0.010])
    c.cpu_s = 0.022
    cost = CompressorCost((0.0, 4e-8), (0.0, 2e-8))  # 10 ms + 5 ms per decode of 250k
    fast = net(rate=1e12)
    fast.cpu = {k: Fit(0.0, 1e15) for k in COLLECTIVES}
    qsgd = hx.algorithms.get("qsgd")
    alone = predict(qsgd, c, fast, cost)
    fast.share = 2.0
    shared = predict(qsgd, c, fast, cost)
    assert alone.compress_s > 0.01
    assert shared.compress_s == pytest.approx(2 * alone.compress_s)
    assert shared.cpu_floor_s == pytest.approx(2 * 0.022 + shared.compress_s, rel=1e-6)
    assert shared.step_s >= shared.cpu_floor_s


def test_error_feedback_algorithms_are_timed_through_feedback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """auto times an error-feedback algorithm's encode as it runs (residual in, local
    decode, residual out), a bare compressor's as it is."""
    from hexagram.cost import measure

    seen: dict[int, bool] = {}

    def fake(comp: object, device: object = "cpu", *, sizes: object = (),
             feedback: bool = False) -> CompressorCost:
        seen[id(comp)] = feedback
        return CompressorCost((0.0, 0.0), (0.0, 0.0))

    monkeypatch.setattr(measure, "measure_compressor", fake)
    topk, qsgd = hx.algorithms.get("topk"), hx.algorithms.get("qsgd")
    measure.local_costs([("topk", topk), ("qsgd", qsgd)], compute([4096], [0.01]), 4)
    assert seen == {id(topk.compressor): True, id(qsgd.compressor): False}  # type: ignore[attr-defined]


def test_feedback_encode_keeps_the_invariant() -> None:
    """The timed feedback encode is error feedback: the input it compressed (buffer plus
    old residual) equals what the payload carries plus the new residual."""
    from hexagram.compress import get
    from hexagram.compress.base import Payload
    from hexagram.cost.profile import _feedback_encode

    comp = get("topk", k=5)
    seen: list[tuple[torch.Tensor, Payload]] = []
    compress = comp.compress

    def spy(t: torch.Tensor, g: torch.Generator | None = None) -> Payload:
        payload = compress(t, g)
        seen.append((t.clone(), payload))
        return payload

    comp.compress = spy  # type: ignore[method-assign,assignment]
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    encode, ef = _feedback_encode(comp, x, torch.Generator().manual_seed(1))
    before = ef.residual("x").clone()
    encode()
    corrected, payload = seen[-1]
    assert torch.allclose(corrected, x + before)  # the residual went in
    assert torch.allclose(comp.decompress(payload) + ef.residual("x"), corrected)
    assert torch.count_nonzero(ef.residual("x")) == 64 - 5
