"""``hexagram simulate``'s cluster: a :class:`~hexagram.cost.hardware.Hardware` of link presets
priced at any world size, and the network (one size-aware fit per collective) the step-time
model reads.

:class:`Cluster` names its links and device by preset (``"nvlink"``, ``"25gbe"``,
``"100mbit"``, ``"h100"``) or gives them as objects (a measured link); the hosts follow from
the world size. :meth:`Cluster.hardware` is its one hardware description (the one the
planner's :class:`hexagram.parallel.cluster.Cluster` reads too: ``Cluster.from_hardware``);
:meth:`Cluster.from_hardware` is the way back. :meth:`Cluster.network` times each message
with the schedule the backend runs for its size (:mod:`hexagram.cost.collectives`) on
:meth:`Cluster.topology`.

Example:
    >>> c = Cluster(devices_per_host=4, intra="pcie4", inter="10gbe", backend="gloo")
    >>> hw = c.hardware(hosts=2)
    >>> hw.devices, hw.inter.name, c.topology(8) == hw.topology()
    (8, '10gbe', True)
    >>> Cluster.from_hardware(hw) == c
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from hexagram.cost.collectives import (
    BACKENDS,
    Topology,
    collective_time,
    gtopk_tree,
    hierarchical_allreduce,
    peer_exchange,
)
from hexagram.cost.devices import EFFICIENCY, Device, Link, device, link
from hexagram.cost.hardware import Hardware
from hexagram.cost.probe import Fit, NetworkProfile
from hexagram.errors import ConfigError

__all__ = ["Cluster", "ClusterNetwork", "ScheduleFit"]


@dataclass(frozen=True)
class ScheduleFit(Fit):
    """A :class:`Fit` whose time runs the collective schedule the backend picks for the
    message's size (:func:`hexagram.cost.collectives.choose`), so latency and rate follow
    ring, tree, recursive doubling or butterfly as the size and world size dictate.
    ``latency_s`` / ``rate_bps`` hold the ring's figures (what a JSON profile records)."""

    op: str = "allreduce"
    topo: Topology | None = None
    backend: str = "nccl"

    def time(self, sent: int, rounds: int = 1) -> float:
        t = self.topo
        if t is None or t.world == 1:
            return super().time(sent, rounds)
        p, d, h = t.world, t.per_host, t.hosts
        # the whole tensor each message is a share of, priced as the planner prices it
        if self.op == "allreduce":
            return collective_time("allreduce", sent * p / (2 * (p - 1)), t, self.backend)
        if self.op == "allgather":
            return collective_time("allgather", sent * p / (p - 1), t, self.backend)
        if self.op == "alltoall":
            return collective_time("all_to_all", sent * p / (p - 1), t, self.backend)
        if self.op == "hierarchical":
            return hierarchical_allreduce(sent / ((d - 1) + 2 * (h - 1) / h), t, self.backend)
        if rounds > 1:  # gTop-k: rank 0 sends k pairs in each of ceil(log2 P) rounds
            return gtopk_tree(sent / math.ceil(math.log2(p)), t)
        return peer_exchange(sent, t)


class ClusterNetwork(NetworkProfile):
    """A :class:`NetworkProfile` of :class:`ScheduleFit` s (size-aware), with a
    ``"hierarchical"`` fit of its own (a probe has none: it fits the intra-host allreduce
    instead). ``to_json`` writes the ring's linear fits."""

    def fit(self, op: str) -> Fit:
        """The op's schedule fit; a ``pair`` message (gTop-k's rounds) runs ``p2p``'s,
        whose ``rounds > 1`` is the gTop-k tree (:func:`~hexagram.cost.collectives.
        gtopk_tree`)."""
        op = "p2p" if op == "pair" else op
        return self.fits[op] if op in self.fits else super().fit(op)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out["fits"] = {k: {"latency_s": v.latency_s, "rate_bps": v.rate_bps}
                       for k, v in self.fits.items()}
        return out


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Hosts of ``devices_per_host`` devices, as many as the world size needs.

    Attributes:
        devices_per_host: ranks per host (more => more traffic shares each host's uplink).
        intra: link inside a host: a preset (:data:`hexagram.cost.devices.LINKS`, or a rate
            such as ``"40gbit"``) or a :class:`~hexagram.cost.devices.Link` (measured).
        inter: link between hosts, the same way (lower rate => communication matters more).
        inter_links: uplinks per host (DGX-style hosts have one NIC per GPU).
        oversubscription: of the inter-host fabric (2.0 => half the rate across hosts).
        backend: whose collective schedules run (:data:`hexagram.cost.collectives.BACKENDS`:
            ``nccl`` ring or tree, ``gloo`` ring only, ``mpi`` MPICH's defaults).
        device: the accelerator, a preset (``"h100"``) or a
            :class:`~hexagram.cost.devices.Device`; None => given to
            :func:`~hexagram.cost.simulate.simulate` apart (its ``dev``) or unknown.
        efficiency: fraction of the device's peak a step reaches (what the planner gets
            from :meth:`hardware`; ``simulate``'s compute profile is built apart).
    """

    devices_per_host: int = 8
    intra: str | Link = "nvlink"
    inter: str | Link = "25gbe"
    inter_links: int = 1
    oversubscription: float = 1.0
    backend: str = "nccl"
    device: str | Device | None = None
    efficiency: float = EFFICIENCY

    def __post_init__(self) -> None:
        for name in ("devices_per_host", "inter_links"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"cluster: {name} must be an integer >= 1, got "
                                  f"{getattr(self, name)!r}")
        if not self.oversubscription >= 1.0:
            raise ConfigError(f"cluster: oversubscription must be >= 1 (1 = full bisection), "
                              f"got {self.oversubscription!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"cluster: backend must be one of {', '.join(BACKENDS)}, got "
                              f"{self.backend!r}")
        self.hardware()  # unknown presets fail here

    def hardware(self, hosts: int = 1) -> Hardware:
        """This cluster's hardware description with ``hosts`` hosts (the planner's
        ``Cluster.from_hardware(c.hardware(hosts=4))`` plans for it)."""
        return Hardware.from_presets(
            hosts=hosts, devices_per_host=self.devices_per_host, intra=self.intra,
            inter=self.inter, inter_links=self.inter_links,
            oversubscription=self.oversubscription, device=self.device,
            efficiency=self.efficiency, backend=self.backend)

    @classmethod
    def from_hardware(cls, hw: Hardware) -> Cluster:
        """The cluster of ``hw``'s hosts, links and device (a preset keeps its name); its
        number of hosts is the world size's business."""
        return cls(devices_per_host=hw.devices_per_host, intra=_named(hw.intra, link),
                   inter=_named(hw.inter, link), inter_links=hw.inter_links,
                   oversubscription=hw.oversubscription, backend=hw.backend,
                   device=None if hw.device is None else _named(hw.device, device),
                   efficiency=hw.efficiency)

    def topology(self, world: int) -> Topology:
        """``world`` ranks on full hosts (or one partial host below ``d``)."""
        if not isinstance(world, int) or world < 1:
            raise ConfigError(f"world size must be an integer >= 1, got {world!r}")
        d = min(self.devices_per_host, world)
        if world % d:
            raise ConfigError(f"world size {world} is not a multiple of devices_per_host "
                              f"{d}; use whole hosts")
        return self.hardware(hosts=world // d).topology(world, d)

    def network(self, world: int) -> ClusterNetwork:
        """The network of ``world`` ranks: each collective's :class:`ScheduleFit`."""
        t = self.topology(world)
        p, d, h = world, t.per_host, t.hosts
        lat = t.intra_lat if h == 1 else t.inter_lat
        ring_lat = 2 * (p - h) * t.intra_lat + 2 * (h - 1) * t.inter_lat
        off = (d * (p - d) / (p * t.inter_bps) if h > 1 else (d - 1) / (p * t.intra_bps))
        linear = {"allreduce": (ring_lat, t.ring_bps),
                  "allgather": (ring_lat / 2, t.ring_bps),
                  "alltoall": (max(lat, t.intra_lat), (p - 1) / p / max(off, 1e-300)),
                  "p2p": (lat, t.ring_bps)}
        if d > 1:
            n = (d - 1) + 2 * (h - 1) / h  # bytes the leader sends per byte of bucket
            linear["hierarchical"] = (0.0, n / max(hierarchical_allreduce(1e9, t, "gloo")
                                                   / 1e9, 1e-300))
        fits: dict[str, Fit] = {op: ScheduleFit(lat_s, rate, op, t, self.backend)
                                for op, (lat_s, rate) in linear.items()}
        intra, inter = (v if isinstance(v, str) else v.name for v in (self.intra, self.inter))
        return ClusterNetwork(world, h, fits, None, notes=[
            f"simulated: {h} x {d}, {intra} / {inter}, {self.backend} schedules"])


_Named = TypeVar("_Named", Link, Device)


def _named(value: _Named, preset: Callable[[str], _Named]) -> str | _Named:
    """``value``'s preset name where the preset of that name is ``value``, else ``value``."""
    try:
        return value.name if preset(value.name) == value else value
    except ConfigError:
        return value
