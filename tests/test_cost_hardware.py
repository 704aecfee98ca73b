"""One hardware description (hexagram.cost.hardware.Hardware): simulate's cluster and the
planner's cluster are views of it, so one description gives one Topology and one price of
a collective through simulate, auto's step-time model and the planner's Mesh, and the two
cluster forms convert into each other."""

from __future__ import annotations

import dataclasses

import pytest

import hexagram as hx
from hexagram.cost.collectives import collective_time
from hexagram.cost.devices import DEVICES, LINKS, Link
from hexagram.cost.hardware import Hardware, measured_link
from hexagram.cost.model import predict
from hexagram.cost.profile import ComputeProfile
from hexagram.cost.schedule import TensorSpec
from hexagram.cost.simulate import Cluster as SimCluster
from hexagram.errors import ConfigError
from hexagram.parallel.cluster import Cluster
from hexagram.parallel.mesh import Mesh

# 2 hosts x 2 ranks; two 10 GbE uplinks per host into a fabric oversubscribed 4:1
HW = Hardware.from_presets(hosts=2, devices_per_host=2, intra="pcie4", inter="10gbe",
                           inter_links=2, oversubscription=4.0, device="a100", backend="gloo")


def _model_price(net: object, nbytes: int) -> float:
    """auto's model: the step of an allreduce of one fp32 tensor, compute taking no time."""
    compute = ComputeProfile(0.0, 0.0, 0.0, [TensorSpec("w", (nbytes // 4,))], [0.0])
    return predict(hx.algorithms.get("allreduce"), compute, net).step_s  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("nbytes", [4_000, 4_000_000])
def test_one_description_one_topology_one_price(backend: str, nbytes: int) -> None:
    hw = HW.replace(backend=backend)
    sim = SimCluster.from_hardware(hw)
    planner = Cluster.from_hardware(hw)
    mesh = Mesh(cluster=planner, d=4, t=1, b=1, microbatches=1, spans_hosts=True)
    topo = hw.topology()
    assert topo.inter_bps == pytest.approx(LINKS["10gbe"].rate_bps / 2)  # 2 links / 4
    assert sim.topology(4) == topo
    for got in (planner.topology(4, 2), mesh.topology("d")):
        assert dataclasses.astuple(got) == pytest.approx(dataclasses.astuple(topo), rel=1e-12)
    net = sim.network(4)
    prices = {"planner": mesh.collective("allreduce", "d", nbytes),
              "simulate": net.fit("allreduce").time(2 * 3 * nbytes // 4),
              "model": _model_price(net, nbytes)}
    expected = collective_time("allreduce", nbytes, topo, backend)
    assert prices == pytest.approx({k: expected for k in prices}, rel=1e-12)


def test_planner_and_simulate_clusters_round_trip() -> None:
    sim = SimCluster.from_hardware(HW)
    assert (sim.intra, sim.inter, sim.device) == ("pcie4", "10gbe", "a100")  # presets named
    assert sim.hardware(hosts=2) == HW and SimCluster.from_hardware(sim.hardware()) == sim
    # the planner's cluster of simulate's presets, with its own correction terms
    fixes = {"op_overhead_us": 7.0, "tp_overhead_us": 30.0, "cores_per_host": 2.0,
             "dp_sync_scale": 1.3, "dtype_bytes": 4}
    planner = Cluster.from_hardware(sim.hardware(hosts=2), **fixes)
    assert (planner.devices, planner.backend) == (4, "gloo")
    assert planner.device_tflops == pytest.approx(DEVICES["a100"].flops * 0.4 / 1e12)
    assert planner.inter_host_gbps == pytest.approx(5.0)  # 2 x 10 Gbit/s / 4
    assert planner.corrections == {**Cluster().corrections, **fixes}
    # planner -> simulate -> planner: the same cluster (up to the units' rounding)
    back = Cluster.from_hardware(SimCluster.from_hardware(planner.hardware).hardware(hosts=2),
                                 **planner.corrections)
    numbers = {k: v for k, v in dataclasses.asdict(planner).items() if not isinstance(v, str)}
    assert {k: getattr(back, k) for k in numbers} == pytest.approx(numbers, rel=1e-12)
    assert (back.backend, back.zero_grad_collective) == ("gloo", "reduce_scatter")
    assert Cluster.from_hardware(planner.hardware, **planner.corrections) == back
    # from_presets is from_hardware of the presets (the planner's backend by default)
    assert Cluster.from_presets(2, 2, intra="pcie4", inter="10gbe", device="a100") \
        == Cluster.from_hardware(HW.replace(inter_links=1, oversubscription=1.0))


def test_measured_links_and_the_planners_units_agree() -> None:
    intra, inter = {"latency_us": 12.0, "gbps": 40.0}, {"latency_us": 300.0, "gbps": 0.1}
    c = Cluster(hosts=2, devices_per_host=2, intra_latency_us=12.0, intra_host_gbps=40.0,
                inter_latency_us=300.0, inter_host_gbps=0.1)
    assert c.hardware.intra == measured_link(intra, "intra-host")
    assert c.hardware.inter == measured_link(inter, "inter-host")
    assert c.link(True) == (c.hardware.inter.latency_s, c.hardware.uplink_bps)
    assert c.memory_bytes == c.hardware.memory_bytes == 80e9
    # a measured link is a link simulate takes as it is
    sim = SimCluster(devices_per_host=2, intra=c.hardware.intra, inter=c.hardware.inter)
    assert sim.topology(4) == c.hardware.replace(backend="nccl").topology()
    assert "intra-host / inter-host" in sim.network(4).notes[0]


def test_bad_hardware_names_the_field() -> None:
    with pytest.raises(ConfigError, match="oversubscription"):
        Hardware(oversubscription=0.5)
    with pytest.raises(ConfigError, match=r"Hardware\.inter must be a Link"):
        Hardware(inter=Link("dead", 0.0, 1e-6))
    with pytest.raises(ConfigError, match=r"Hardware\.efficiency"):
        Hardware(efficiency=0.0)
    with pytest.raises(ConfigError, match="give a device"):
        _ = Hardware().flops
    with pytest.raises(ConfigError, match="unknown device profile"):
        SimCluster(device="tpu9")
    with pytest.raises(ConfigError, match="multiple of per_host"):
        HW.topology(3, per_host=2)


def test_simulate_reads_the_clusters_device() -> None:
    from hexagram.algorithms.labels import simulable
    from hexagram.cost.devices import device
    from hexagram.cost.simulate import params_compute, simulate

    compute = params_compute(2_000_000, layers=4, dev="p102")
    labels, worlds = ["allreduce", "topk"], [8, 512]
    own = simulate(labels, worlds, compute, SimCluster(device="p102"), make=simulable)
    given = simulate(labels, worlds, compute, SimCluster(), device("p102"), make=simulable)
    none = simulate(labels, worlds, compute, SimCluster(), make=simulable)
    assert own == given
    # with a device, top-k's encode and decode cost HBM time; without one, nothing
    assert [r.compress_s > 0 for r in own] == [False, True, False, True]
    assert [r.compress_s for r in none] == [0.0] * 4
