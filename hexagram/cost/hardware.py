"""The one hardware description the pricing kernel reads: hosts, devices, links, backend.

A :class:`Hardware` is ``hosts`` machines of ``devices_per_host`` accelerators, a link
inside a host and a link from each host into the fabric (presets of
:data:`hexagram.cost.devices.LINKS`, or measured: :func:`measured_link` of
:func:`hexagram.cost.links.fit_links`), the host's uplinks and the fabric's
oversubscription, the device (:data:`hexagram.cost.devices.DEVICES` or measured figures)
with the fraction of its peak a training step reaches, and whose collective schedules run.
Units are the kernel's: bytes per second, seconds, FLOP/s, bytes.

Both clusters are views of it: :class:`hexagram.cost.simulate.Cluster` (link presets,
priced at any world size: :meth:`~hexagram.cost.simulate.Cluster.hardware`) and the
planner's :class:`hexagram.parallel.cluster.Cluster` (the same figures in its own units, plus
the correction terms the planner measures: ``Cluster.hardware``, ``Cluster.from_hardware``).
:meth:`Hardware.topology` lays a collective's ranks on the hosts
(:class:`hexagram.cost.collectives.Topology`), which every price is computed on.

Example:
    >>> hw = Hardware.from_presets(hosts=2, devices_per_host=4, intra="pcie4", inter="10gbe",
    ...                            device="a100")
    >>> t = hw.topology()
    >>> t.world, t.hosts, t.inter_bps == hw.inter.rate_bps
    (8, 2, True)
    >>> hw.topology(4, per_host=2, uplink_share=2).inter_bps == hw.inter.rate_bps / 2
    True
    >>> round(hw.flops / 1e12, 1), hw.devices
    (124.8, 8)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hexagram.config import check_choice, check_float, check_int
from hexagram.cost.collectives import BACKENDS, Topology
from hexagram.cost.devices import EFFICIENCY, LINKS, Device, Link, device, link
from hexagram.errors import ConfigError

__all__ = ["Hardware", "measured_link"]


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Hosts, devices and links of a cluster (see the module's docstring).

    Attributes:
        hosts: machines (more => more ranks behind the slower inter-host link).
        devices_per_host: accelerators (ranks) per host; more => more traffic shares each
            host's uplink.
        intra: the link between devices of one host (rate per direction, hop latency).
        inter: one uplink of a host into the fabric; lower rate => communication matters more.
        inter_links: uplinks per host (DGX-style hosts have one NIC per GPU).
        oversubscription: of the inter-host fabric (2.0 => half the rate across hosts).
        device: the accelerator (peak FLOP/s, memory bandwidth and size); None => unknown
            (only links are described: enough to price collectives).
        efficiency: fraction of ``device.flops`` a training step reaches (1.0 where the
            figure is measured rather than a datasheet peak).
        backend: whose collective schedules run (:data:`hexagram.cost.collectives.BACKENDS`).
    """

    hosts: int = 1
    devices_per_host: int = 8
    intra: Link = LINKS["nvlink"]
    inter: Link = LINKS["25gbe"]
    inter_links: int = 1
    oversubscription: float = 1.0
    device: Device | None = None
    efficiency: float = EFFICIENCY
    backend: str = "nccl"

    def __post_init__(self) -> None:
        for name in ("hosts", "devices_per_host", "inter_links"):
            check_int(self, name, low=1)
        if not self.oversubscription >= 1.0:
            raise ConfigError(f"Hardware.oversubscription must be >= 1 (1 = full bisection), "
                              f"got {self.oversubscription!r}")
        check_float(self, "efficiency", low=0.0, high=1.0, low_open=True)
        check_choice(self, "backend", BACKENDS)
        for name in ("intra", "inter"):
            ln = getattr(self, name)
            if not isinstance(ln, Link) or not ln.rate_bps > 0 or not ln.latency_s >= 0:
                raise ConfigError(f"Hardware.{name} must be a Link with a rate > 0 bytes/s "
                                  f"and a latency >= 0 s (a LINKS preset: link('25gbe')), "
                                  f"got {ln!r}")
        if self.device is not None and not isinstance(self.device, Device):
            raise ConfigError(f"Hardware.device must be a Device (e.g. device('h100')) or "
                              f"None, got {self.device!r}")

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def uplink_bps(self) -> float:
        """One host's rate into the fabric: ``links x rate / oversubscription``."""
        return self.inter.rate_bps * self.inter_links / self.oversubscription

    @property
    def flops(self) -> float:
        """FLOP/s one device reaches in a training step (``device.flops x efficiency``)."""
        return self._device().flops * self.efficiency

    @property
    def memory_bps(self) -> float:
        """One device's memory bandwidth, bytes/s (memory-bound operators)."""
        return self._device().hbm_bps

    @property
    def memory_bytes(self) -> float:
        """One device's memory, bytes."""
        return self._device().memory

    def _device(self) -> Device:
        if self.device is None:
            raise ConfigError("Hardware.device is None: give a device (e.g. device('h100')) "
                              "to price compute or memory")
        return self.device

    def topology(self, ranks: int | None = None, per_host: int | None = None,
                 uplink_share: int = 1) -> Topology:
        """``ranks`` of one collective (default: every device), ``per_host`` of them on each
        host (default: as many as fit, ``min(devices_per_host, ranks)``), on these links;
        ``uplink_share`` collectives at once share each host's uplink (the planner's
        data-parallel rings, one per tensor-parallel rank). The hosts such a layout needs
        are taken as alike (a simulated cluster grows with the world size).

        Raises:
            ConfigError: ``ranks`` not a multiple of ``per_host``, a count below 1.
        """
        n = self.devices if ranks is None else ranks
        d = min(self.devices_per_host, n) if per_host is None else per_host
        if uplink_share < 1:
            raise ConfigError(f"uplink_share must be >= 1, got {uplink_share!r}")
        return Topology(n, d, self.intra.rate_bps, self.intra.latency_s,
                        self.uplink_bps / uplink_share, self.inter.latency_s)

    def replace(self, **changes: Any) -> Hardware:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_presets(cls, *, intra: str | Link = "nvlink", inter: str | Link = "25gbe",
                     device: str | Device | None = None, **fields: Any) -> Hardware:
        """Links and device by preset name (:func:`~hexagram.cost.devices.link`: ``"nvlink"``,
        ``"25gbe"``, ``"100mbit"``; :func:`~hexagram.cost.devices.device`: ``"h100"``) or
        as objects; the other fields from ``fields``.

        Raises:
            ConfigError: an unknown preset (the message lists the known ones).
        """
        return cls(intra=_link(intra), inter=_link(inter), device=_device(device), **fields)


def _link(value: str | Link) -> Link:
    return link(value) if isinstance(value, str) else value


def _device(value: str | Device | None) -> Device | None:
    return device(value) if isinstance(value, str) else value


def measured_link(figures: Mapping[str, float], name: str = "measured") -> Link:
    """A :class:`~hexagram.cost.devices.Link` from a fit's ``latency_us`` and ``gbps``
    (Gbit/s), as :func:`hexagram.cost.links.fit_links` returns them (converted as the
    planner's :class:`~hexagram.parallel.cluster.Cluster` converts its fields).

    Example:
        >>> ln = measured_link({"latency_us": 50.0, "gbps": 8.0})
        >>> ln.rate_bps, round(ln.latency_s * 1e6, 9)
        (1000000000.0, 50.0)
    """
    return Link(name, figures["gbps"] * 1e9 / 8, figures["latency_us"] * 1e-6)
