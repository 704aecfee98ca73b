"""Collective schedule formulas (hexagram.cost.collectives) against hand-computed cases."""

from __future__ import annotations

import pytest

from hexagram.cost.collectives import (
    Topology,
    alltoall,
    choose,
    gtopk_tree,
    halving_doubling_allreduce,
    hierarchical_allreduce,
    peer_exchange,
    periodic,
    recursive_doubling_allgather,
    recursive_doubling_allreduce,
    ring_allgather,
    ring_allreduce,
    tree_allreduce,
)
from hexagram.errors import ConfigError

# 2 hosts x 4 ranks: 100 GB/s / 1 us inside, 10 GB/s / 10 us uplink per host
T = Topology(8, 4, 100e9, 1e-6, 10e9, 10e-6)
US = 1e-6


def test_ring_allreduce_and_allgather() -> None:
    # 2 (P-H) = 12 intra hops, 2 (H-1) = 2 inter hops; 2 (P-1)/P n = 14e6 B at 10 GB/s
    assert ring_allreduce(8e6, T) == pytest.approx(12 * US + 20 * US + 1.4e-3)
    # allgather: 6 intra + 1 inter hop; (P-1) m = 7e6 B at 10 GB/s
    assert ring_allgather(1e6, T) == pytest.approx(6 * US + 10 * US + 0.7e-3)
    one_host = Topology(4, 4, 100e9, 1e-6, 10e9, 10e-6)  # no uplink on the path
    assert ring_allreduce(4e6, one_host) == pytest.approx(6 * US + 6e6 / 100e9)
    assert ring_allreduce(1e9, Topology(1, 1, 1.0, 1.0, 1.0, 1.0)) == 0.0


def test_tree_allreduce_is_log_in_hosts() -> None:
    # chain of 3 intra hops + depth log2(2) = 1 inter, both ways; 2 n at 0.9 x 10 GB/s
    assert tree_allreduce(9e6, T) == pytest.approx(2 * (3 * US + 10 * US) + 2e-3)
    big = Topology(4096, 8, 450e9, 3e-6, 3.125e9, 20e-6)  # 512 hosts
    tree_lat = 2 * (7 * 3e-6 + 9 * 20e-6)
    ring_lat = 2 * (4096 - 512) * 3e-6 + 2 * 511 * 20e-6
    assert tree_allreduce(0, big) == pytest.approx(tree_lat)
    assert ring_allreduce(0, big) == pytest.approx(ring_lat)
    assert ring_lat / tree_lat > 50  # large P: the ring's latency is what the tree avoids


def test_recursive_doubling_and_halving_doubling() -> None:
    # rounds at distance 1, 2 (inside) and 4 (across, 4 ranks share 10 GB/s -> 2.5 GB/s)
    n = 1e6
    want = 2 * (US + n / 100e9) + 10 * US + n / 2.5e9
    assert recursive_doubling_allreduce(n, T) == pytest.approx(want)
    # halving: distance 4 (n/2), 2 (n/4), 1 (n/8), then back; across only at distance 4
    half = 10 * US + (n / 2) / 2.5e9
    inside = 2 * US + (n / 4 + n / 8) / 100e9
    assert halving_doubling_allreduce(n, T) == pytest.approx(2 * (half + inside))
    # allgather by recursive doubling: m, 2m inside, 4m across
    m = 1e5
    assert recursive_doubling_allgather(m, T) == pytest.approx(
        2 * US + 3 * m / 100e9 + 10 * US + 4 * m / 2.5e9)
    # 6 ranks (non-power of two): two extra full-size hops fold ranks 4, 5 in
    six = Topology(6, 2, 100e9, 1e-6, 10e9, 10e-6)
    fold = 2 * (10 * US + n / 5e9)  # distance 4 crosses hosts, 2 ranks share the uplink
    rounds = US + n / 100e9 + 10 * US + n / 5e9  # distance 1 inside, 2 across
    assert recursive_doubling_allreduce(n, six) == pytest.approx(fold + rounds)


def test_alltoall_hierarchical_peer_and_periodic() -> None:
    # a host's 4 ranks push 4 (8-4)/8 = 2 x their data through the 10 GB/s uplink
    assert alltoall(8e6, T) == pytest.approx(10 * US + 8e6 * 2 / 10e9)
    # leader: 3 n in and 3 n out at 100 GB/s; 2 leaders allreduce (one ring hop each way)
    n = 1e6
    leaders = 2 * 10 * US + n / 10e9  # ring of 2: 2 (P-1)/P n = n at 10 GB/s
    assert hierarchical_allreduce(n, T, "gloo") == pytest.approx(
        2 * (US + 3 * n / 100e9) + leaders)
    assert peer_exchange(2e6, T) == pytest.approx(10 * US + 2e6 / 10e9)
    assert periodic(0.8, 8) == pytest.approx(0.1)
    assert periodic(0.8, 8, hidden_s=0.5) == 0.0
    with pytest.raises(ConfigError, match="period"):
        periodic(1.0, 0)


def test_gtopk_tree_log_rounds_and_shared_uplink() -> None:
    pair = 8e3  # k = 1000 pairs of 8 bytes
    # butterfly: distance 1, 2 inside, 4 across at 10/4 GB/s
    assert gtopk_tree(pair, T) == pytest.approx(
        2 * (US + pair / 100e9) + 10 * US + pair / 2.5e9)
    # 6 ranks, 1 per host: binomial tree up 3 rounds and down 3, all across hosts
    six = Topology(6, 1, 100e9, 1e-6, 10e9, 10e-6)
    assert gtopk_tree(pair, six) == pytest.approx(6 * (10 * US + pair / 10e9))
    # the published cost: 2 alpha log P + 4 k beta log P grows with log P, not P
    flat = [gtopk_tree(pair, Topology(p, 1, 1e9, 1e-4, 1e9, 1e-4)) for p in (4, 16, 256)]
    assert flat[1] == pytest.approx(2 * flat[0]) and flat[2] == pytest.approx(4 * flat[0])


def test_backend_choice_by_size_and_world() -> None:
    # NCCL: tree for small messages, ring for large ones (hand-computed crossover)
    assert choose("nccl", "allreduce", 1e3, T)[0] == "tree"
    name, secs = choose("nccl", "allreduce", 8e6, T)
    assert name == "ring" and secs == pytest.approx(ring_allreduce(8e6, T))
    # ring T(n) = 32 us + 1.75 n / 1e10; tree T(n) = 26 us + 2 n / 9e9: equal at n ~ 127 kB
    assert choose("nccl", "allreduce", 100e3, T)[0] == "tree"
    assert choose("nccl", "allreduce", 130e3, T)[0] == "ring"
    # gloo: always the ring (gloo::allreduce maps UNSPECIFIED to ring)
    assert choose("gloo", "allreduce", 1.0, T)[0] == "ring"
    # MPICH: recursive doubling up to 2 KiB, halving-doubling beyond
    assert choose("mpi", "allreduce", 2048, T)[0] == "recursive_doubling"
    assert choose("mpi", "allreduce", 2049, T)[0] == "halving_doubling"
    assert choose("mpi", "allgather", 1e3, T)[0] == "recursive_doubling"
    assert choose("mpi", "allgather", 1e5, T)[0] == "ring"  # 800 kB gathered > 512 KiB
    assert choose("nccl", "allgather", 1e3, T)[0] == "ring"
    with pytest.raises(ConfigError, match="backend"):
        choose("ucx", "allreduce", 1.0, T)
    with pytest.raises(ConfigError, match="op"):
        choose("nccl", "broadcast", 1.0, T)
    with pytest.raises(ConfigError, match="multiple"):
        Topology(6, 4, 1.0, 0.0, 1.0, 0.0)
    with pytest.raises(ConfigError, match="rates"):
        Topology(4, 4, 0.0, 0.0, 1.0, 0.0)
