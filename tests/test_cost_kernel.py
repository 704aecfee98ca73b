"""One pricing kernel: the same collective on the same cluster gets the same price from the
step-time model behind ``algorithm="auto"`` and ``advise`` (hexagram.cost.model), from
``simulate`` (hexagram.cost.simulate) and from the planner (hexagram.parallel.mesh.Mesh),
and that price is hexagram.cost.collectives' schedule."""

from __future__ import annotations

import pytest

import hexagram as hx
from hexagram.cost.collectives import Topology, collective_time, ring_allreduce
from hexagram.cost.devices import link
from hexagram.cost.model import predict
from hexagram.cost.profile import ComputeProfile
from hexagram.cost.schedule import TensorSpec
from hexagram.cost.simulate import Cluster as SimCluster
from hexagram.parallel.cluster import Cluster
from hexagram.parallel.mesh import Mesh

INTRA, INTER = "pcie4", "10gbe"  # 31.5 GB/s, 5 us inside a host; 1.25 GB/s, 30 us across


def _model_price(net: object, nbytes: int) -> float:
    """auto's model: the step of an allreduce of one fp32 tensor, compute taking no time."""
    tensor = TensorSpec("w", (nbytes // 4,))
    compute = ComputeProfile(0.0, 0.0, 0.0, [tensor], [0.0])
    return predict(hx.algorithms.get("allreduce"), compute, net).step_s  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("nbytes", [4_000, 4_000_000])
def test_a_ring_over_2_hosts_x_2_ranks_has_one_price(backend: str, nbytes: int) -> None:
    planner = Mesh(cluster=Cluster.from_presets(2, 2, intra=INTRA, inter=INTER,
                                                backend=backend),
                   d=4, t=1, b=1, microbatches=1, spans_hosts=True)
    net = SimCluster(devices_per_host=2, intra=INTRA, inter=INTER, backend=backend).network(4)
    sent = 2 * 3 * nbytes // 4  # what one rank sends in a ring allreduce of 4 ranks
    prices = {"planner": planner.collective("allreduce", "d", nbytes),
              "simulate": net.fit("allreduce").time(sent),
              "model": _model_price(net, nbytes)}
    a, e = link(INTRA), link(INTER)
    t = Topology(4, 2, a.rate_bps, a.latency_s, e.rate_bps, e.latency_s)
    expected = collective_time("allreduce", nbytes, t, backend)
    assert prices == pytest.approx({k: expected for k in prices}, rel=1e-12)
    if backend == "gloo":  # the ring: 4 hops inside a host, 2 across; bytes at the uplink
        ring = 4 * a.latency_s + 2 * e.latency_s + 1.5 * nbytes / e.rate_bps
        assert expected == pytest.approx(ring_allreduce(nbytes, t)) == pytest.approx(ring)
        assert expected < 6 * e.latency_s + 1.5 * nbytes / e.rate_bps  # not 6 across


def test_allgather_and_reduce_scatter_agree_between_simulate_and_the_planner() -> None:
    cluster = Cluster.from_presets(2, 4, intra=INTRA, inter=INTER)
    mesh = Mesh(cluster=cluster, d=8, t=1, b=1, microbatches=1, spans_hosts=True)
    net = SimCluster(devices_per_host=4, intra=INTRA, inter=INTER, backend="gloo").network(8)
    x = 8_000_000  # the gathered tensor: 1 MB from each of 8 ranks
    assert mesh.collective("allgather", "d", x) == pytest.approx(
        net.fit("allgather").time(7 * x // 8), rel=1e-12)
    # reduce-scatter is the ring allreduce's first half, hop for hop and byte for byte
    assert mesh.collective("reduce_scatter", "d", x) == pytest.approx(
        mesh.collective("allreduce", "d", x) / 2, rel=1e-12)


def test_the_planners_axes_sit_on_the_hosts() -> None:
    c = Cluster.from_presets(2, 2, intra=INTRA, inter=INTER)
    # dp=2 x tp=2 over 2 hosts: each data-parallel ring has one rank per host, and the two
    # rings (one per tensor-parallel rank) share each host's uplink
    mesh = Mesh(cluster=c, d=2, t=2, b=1, microbatches=1, spans_hosts=True)
    assert (mesh.topology("d").hosts, mesh.topology("d").per_host) == (2, 1)
    assert mesh.topology("d").inter_bps == pytest.approx(link(INTER).rate_bps / 2)
    assert mesh.topology("t").hosts == 1
    # a fractional count pays a share of the latency, all of the bytes
    whole, share = mesh.collective("allreduce", "d", 1e6), mesh.collective(
        "allreduce", "d", 1e6, count=0.25)
    assert whole - share == pytest.approx(0.75 * 2 * link(INTER).latency_s)


def test_one_fit_for_links_and_cpu_costs() -> None:
    from hexagram.cost.fit import Fit, cost_line, fit_allreduce, fit_line, line_through
    from hexagram.parallel.calibrate import fit_alpha_beta

    # a + b n as a Fit: 2 us + 1 ns per element
    assert Fit.line(2e-6, 1e-9).time(1000) == pytest.approx(3e-6)
    assert Fit.line(2e-6, 1e-9).slope == pytest.approx(1e-9)
    points = [(100.0, 2e-6 + 100e-9), (1100.0, 2e-6 + 1100e-9), (600.0, 2e-6 + 600e-9)]
    assert cost_line(points) == pytest.approx((2e-6, 1e-9))
    assert fit_line(points).latency_s == pytest.approx(2e-6)
    assert fit_line(points).rate_bps == pytest.approx(1e9)
    assert cost_line([(1.0, 5.0), (2.0, 4.0)]) == (4.5, 0.0)  # noise: no negative slope
    assert line_through(100, 2e-6, 1100, 3e-6) == pytest.approx((1.9e-6, 1e-9))
    # the planner's calibration reports the kernel's ring fit in its own units
    sizes, times = [8e3, 8e6], [1e-3 + 1.5 * 8e3 / 1e9, 1e-3 + 1.5 * 8e6 / 1e9]
    ring = fit_allreduce(4, sizes, times)
    assert ring.latency_s * 1e6 == pytest.approx(fit_alpha_beta(4, sizes, times)["latency_us"])
    assert ring.rate_bps == pytest.approx(1e9) and ring.latency_s == pytest.approx(1e-3 / 6)


def test_one_stopwatch() -> None:
    from hexagram.cost.stopwatch import best_time, fastest

    ticks = iter([0.0, 3.0, 3.0, 4.0, 4.0, 9.0])  # runs of 3, 1 and 5 "seconds"
    calls: list[int] = []

    def run() -> int:
        calls.append(1)
        return len(calls)

    took, last = fastest(run, 3, lambda: next(ticks))
    assert (took, last) == (1.0, 3)  # the least of the three, the last run's result
    with pytest.raises(ValueError, match="repeat"):
        fastest(lambda: None, 0)
    with pytest.raises(ValueError, match="stat"):
        best_time(lambda: None, 1, stat="mean")
