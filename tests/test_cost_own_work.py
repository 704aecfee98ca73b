"""The model's CPU and wire rules for gTop-k's tree and scatter-gather, by hand."""

from __future__ import annotations

import pytest

import hexagram as hx
from hexagram.cost.measure import local_costs
from hexagram.cost.model import predict
from hexagram.cost.own_work import gtopk_tree_cost
from hexagram.cost.probe import COLLECTIVES, Fit, NetworkProfile, exchange_fit
from hexagram.cost.profile import CompressorCost, ComputeProfile, TreeCost
from hexagram.cost.schedule import TensorSpec, bucket_schedule, step_schedule


def one_tensor(n: int, ready: float = 0.010) -> ComputeProfile:
    return ComputeProfile(0.005, ready, 0.002, [TensorSpec("w", (n,))], [ready])


def fast_net(world: int = 4) -> NetworkProfile:
    return NetworkProfile(world, world, {k: Fit(0.0, 1e15) for k in COLLECTIVES})


def test_gtopk_tree_cost_replaces_the_decodes() -> None:
    # 4 ranks: 2 merge rounds. once 1 ms, a round 2 ms + 1e-8 s/element: for 250k
    # elements 1 + 2 * (2 + 2.5) = 10 ms on the communication thread; no encode cost.
    # Without the tree: one decode per merge and one of the result, 3 x 2.5 ms.
    tree = TreeCost((0.001, 0.0), (0.002, 1e-8))
    with_tree = CompressorCost((0.0, 0.0), (0.0, 1e-8), tree)
    bare = CompressorCost((0.0, 0.0), (0.0, 1e-8))
    gtopk = hx.algorithms.get("gtopk")
    p = predict(gtopk, one_tensor(250_000), fast_net(), with_tree)
    assert p.compress_s == pytest.approx(0.010)
    assert p.step_s == pytest.approx(0.005 + 0.010 + 0.010 + 0.002, rel=1e-6)
    assert predict(gtopk, one_tensor(250_000), fast_net(), bare).compress_s == \
        pytest.approx(0.0075)
    # 8 ranks: 3 rounds
    assert predict(gtopk, one_tensor(250_000), fast_net(8), with_tree).compress_s == \
        pytest.approx(0.001 + 3 * 0.0045)


def test_scatter_gather_counts_every_chunk_call() -> None:
    # QSGD on 4 ranks, one tensor of 400k: P = 4 chunks of 100k, each compressed on its own
    # (1 ms + 1 ms each: 8 ms on the training thread); then 4 decodes of the received
    # chunks, 1 encode of the reduced one, 4 decodes of the gathered ones (0.2 + 0.5 ms
    # each): 8 x 0.7 + 2 = 7.6 ms
    cost = CompressorCost((1e-3, 1e-8), (2e-4, 5e-9))
    qsgd = hx.algorithms.get("qsgd")
    assert [m.op for m in bucket_schedule(qsgd, [TensorSpec("w", (400_000,))], 4)] == \
        ["alltoall", "allgather"]
    p = predict(qsgd, one_tensor(400_000), fast_net(), cost)
    assert p.compress_s == pytest.approx(0.008 + 0.0076)
    # the encode delays the bucket (training thread), the rest follows the messages
    assert p.step_s == pytest.approx(0.005 + 0.010 + 0.008 + 0.0076 + 0.002, rel=1e-6)


def test_gtopk_rounds_priced_as_one_partner_exchanges() -> None:
    # ring allreduce: 6 ms over its 2 (P-1) = 6 steps -> 1 ms a hop; two-neighbour
    # exchange: 6 MB/s. gTop-k on 4 ranks: 2 rounds of k pairs (k = 5 % of 200k = 10k,
    # 8 bytes a pair: 80 kB a round, 160 kB in all).
    fits = {k: Fit(0.0, 1e15) for k in COLLECTIVES}
    fits.update(allreduce=Fit(0.006, 1e7), p2p=Fit(0.02, 6e6))
    net = NetworkProfile(4, 4, fits)
    assert net.fit("pair") == exchange_fit(fits["allreduce"], fits["p2p"], 4) == \
        Fit(0.001, 6e6)
    gtopk = hx.algorithms.get("gtopk")
    p = predict(gtopk, one_tensor(200_000), net)
    [[msg, fault]] = p.schedule
    assert (msg.op, msg.sent, msg.rounds) == ("pair", 160_000, 2)
    # then the step's one fault allreduce: one int64 on the ring (12 bytes sent on 4 ranks)
    assert (fault.op, fault.sent) == ("allreduce", 12)
    assert p.step_s == pytest.approx(0.005 + 0.010 + 2 * 0.001 + 160_000 / 6e6 + 0.002
                                     + 0.006 + 12 / 1e7)


def test_gtopk_agrees_on_faults_once_per_step_after_the_last_bucket() -> None:
    # three buckets (one tensor each): three pair exchanges, then ONE 8-byte allreduce
    gtopk = hx.algorithms.get("gtopk")
    specs = [TensorSpec(name, (1 << 20,)) for name in "abc"]
    compute = ComputeProfile(0.005, 0.010, 0.002, specs, [0.004, 0.007, 0.010])
    p = predict(gtopk, compute, fast_net(), bucket_bytes=4 << 20, first_bucket_bytes=4 << 20)
    assert [[m.op for m in msgs] for msgs in p.schedule] == \
        [["pair"], ["pair"], ["pair", "allreduce"]]
    assert p.schedule[-1][-1].sent == 12
    layout = [[spec] for spec in specs]
    ops = [[m.op for m in msgs] for msgs in step_schedule(gtopk, layout, 4)]
    assert ops == [["pair"], ["pair"], ["pair", "allreduce", "allreduce"]]  # the guard's
    assert step_schedule(gtopk, layout, 1) == [[], [], []]  # alone: nothing to agree on


def test_exchange_cpu_from_the_ring_and_p2p_cpu_fits() -> None:
    net = fast_net()
    assert net.cpu_fit("pair") is None  # CPU not measured
    net.cpu = {"allreduce": Fit(0.012, 1e9), "p2p": Fit(0.5, 2e8)}
    assert net.cpu_fit("pair") == Fit(0.002, 2e8)
    assert net.cpu_fit("tree") == net.cpu["p2p"] and net.cpu_fit("alltoall") is None


def test_gtopk_tree_cost_is_timed_on_the_job_shapes() -> None:
    """auto's compressor timing adds gTop-k's tree work (real merges of real payloads);
    algorithms without one get none."""
    gtopk, topk = hx.algorithms.get("gtopk"), hx.algorithms.get("topk")
    specs = [TensorSpec("a", (64, 64)), TensorSpec("b", (256, 256))]
    prof = ComputeProfile(0.0, 0.0, 0.0, specs, [0.0, 0.0])
    costs = local_costs([("gtopk", gtopk), ("topk", topk)], prof, 4)
    assert costs["topk"].tree is None
    tree = costs["gtopk"].tree
    assert tree is not None and tree.seconds(65536, 2) > 0.0
    direct = gtopk_tree_cost(gtopk, ((64, 64), (256, 256)))
    assert direct.per_round[1] >= 0.0 and direct.once[1] >= 0.0


def test_tree_cost_arithmetic() -> None:
    t = TreeCost((1e-3, 1e-9), (2e-3, 1e-8))
    assert t.seconds(10**6, 0) == pytest.approx(0.002)
    assert t.seconds(10**6, 3) == pytest.approx(0.002 + 3 * 0.012)


def test_qadam_encode_is_timed_through_its_feedback() -> None:
    """QAdam keeps its ErrorFeedback as ``feedback`` (on the momentum): its encode is timed
    as error feedback's, like the compressed algorithms' ``error_feedback``."""
    from hexagram.cost.measure import _has_feedback

    got = {n: _has_feedback(hx.algorithms.get(n)) for n in ("qadam", "topk", "qsgd", "fp16")}
    assert got == {"qadam": True, "topk": True, "qsgd": False, "fp16": False}


def test_qadam_momentum_arithmetic_adds_to_encode_and_decode_by_hand() -> None:
    # one 250k bucket, a free network, share 1: the transform to momentum (0 + 1e-8 s per
    # element: 2.5 ms) delays the bucket on the training thread, the transform back
    # (1 ms + 2e-8 s per element: 6 ms) follows the exchange; the bare compressor is free
    qadam = hx.algorithms.get("qadam")
    bare = CompressorCost((0.0, 0.0), (0.0, 0.0))
    own = CompressorCost((0.0, 0.0), (0.0, 0.0), TreeCost((0.0, 1e-8), (0.001, 2e-8)))
    assert predict(qadam, one_tensor(250_000), fast_net(), bare).compress_s == 0.0
    p = predict(qadam, one_tensor(250_000), fast_net(), own)
    assert p.compress_s == pytest.approx(0.0025 + 0.006)
    # 5 ms forward + (10 ms ready + 2.5 ms encode + 6 ms decode) + 2 ms update
    assert p.step_s == pytest.approx(0.005 + 0.0185 + 0.002, rel=1e-6)


def test_qadam_own_work_is_timed_on_the_job_shapes() -> None:
    specs = [TensorSpec("a", (64, 64)), TensorSpec("b", (256, 256))]
    prof = ComputeProfile(0.0, 0.0, 0.0, specs, [0.0, 0.0])
    costs = local_costs([("qadam", hx.algorithms.get("qadam"))], prof, 4)
    tree = costs["qadam"].tree
    assert tree is not None and tree.seconds(65536, 1) > 0.0


def test_job_compute_adds_the_optimizer_difference_to_qadam_only() -> None:
    from hexagram.algorithms.qadam import optimizer_extra_s
    from hexagram.cost.own_work import job_compute

    c = ComputeProfile(0.0, 0.10, 0.01, [TensorSpec("w", (10,))], [0.1], cpu_s=0.08)
    q = job_compute("qadam", c, 0.02)
    assert (q.update_s, q.cpu_s, q.backward_s) == pytest.approx((0.03, 0.10, 0.10))
    assert job_compute("allreduce", c, 0.02) is c
    assert job_compute("qadam", ComputeProfile(0.0, 0.1, 0.0, [], []), 0.02).cpu_s is None
    assert optimizer_extra_s([(64, 64), (64,)]) >= 0.0
