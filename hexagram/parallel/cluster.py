"""The planner's input: a validated description of the cluster and of the degrees to keep.

:class:`Cluster` is the cost model's one hardware description
(:class:`hexagram.cost.hardware.Hardware`: hosts, devices, the links inside and between
hosts, the backend) in the planner's units, plus the correction terms the planner measures
on top of the kernel's prices (framework overheads, core sharing, the gradient sync's
scale). Its link and device fields are the keyword and JSON form; :attr:`Cluster.hardware`
is what every price reads (:meth:`Cluster.topology`, the planner's
:class:`~hexagram.parallel.mesh.Mesh`). :meth:`Cluster.from_hardware` plans for any
hardware description, ``hexagram simulate``'s presets included
(:meth:`hexagram.cost.simulate.Cluster.hardware`). Every field is checked in
``__post_init__`` with an actionable message naming it (torchtitan ``ParallelDims`` style).
Rates are *achievable* figures, not peaks; :mod:`hexagram.parallel.calibrate` measures them
here.

Units: link rates in gigabits per second (Gbit/s, as NICs are sold), compute in TFLOP/s,
memory in GB (1e9 bytes), latencies in microseconds.

Example:
    >>> c = Cluster(hosts=2, devices_per_host=8, intra_host_gbps=600, inter_host_gbps=100,
    ...             device_memory_gb=80)
    >>> c.devices, [m.devices for m in c.submeshes()]
    (16, [1, 2, 4, 8, 16])
    >>> Cluster.parse("4x8").devices
    32
    >>> c.hardware.inter.rate_bps * 8 / 1e9, c.hardware.topology().hosts
    (100.0, 2)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hexagram.config import check_choice, check_float, check_int
from hexagram.cost.collectives import BACKENDS, Topology
from hexagram.cost.devices import Device, Link
from hexagram.cost.hardware import Hardware
from hexagram.errors import ConfigError
from hexagram.parallel.rules import check_priced

__all__ = ["Cluster", "Constraints", "Submesh"]

#: the planner's fields that are the hardware description's (:attr:`Cluster.hardware`)
_HARDWARE_FIELDS = frozenset({
    "hosts", "devices_per_host", "intra_host_gbps", "inter_host_gbps", "device_memory_gb",
    "device_tflops", "memory_gbps", "intra_latency_us", "inter_latency_us", "backend"})


@dataclass(frozen=True)
class Submesh:
    """``hosts`` x ``devices`` per host: Alpa's submesh shapes ((1, 2^k) or (n, all))."""

    hosts: int
    per_host: int

    @property
    def devices(self) -> int:
        return self.hosts * self.per_host


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Devices, memory and links of the cluster to plan for.

    Attributes:
        hosts: machines; more hosts => more devices behind the slow inter-host link.
        devices_per_host: accelerators per host (a power of two: Alpa's (1, 2^k) submeshes
            must tile a host).
        intra_host_gbps: link rate between devices of one host (Gbit/s); higher => tensor
            parallelism inside a host gets cheaper.
        inter_host_gbps: network rate of one host (Gbit/s, shared by its devices); lower =>
            pipeline stages across hosts win over data parallelism.
        device_memory_gb: memory per device (GB); lower => more sharding/stages needed.
        device_tflops: achievable TFLOP/s of one device in the training dtype.
        memory_gbps: device memory bandwidth (GB/s) for memory-bound operators.
        intra_latency_us, inter_latency_us: alpha of one message on each link.
        op_overhead_us: fixed cost per operator launch (kernel launch, Python dispatch).
        tp_overhead_us: per tensor-parallel ``nn.Linear``, forward + backward: DTensor's
            dispatch and redistribute bookkeeping beyond its collectives' alpha-beta time;
            higher => tensor parallelism of small operators loses.
        zero_overhead_us: per ZeRO-sharded module and micro-batch: FSDP2's hooks and
            all-gather / reduce-scatter bookkeeping; higher => fewer ZeRO plans.
        microbatch_overhead_us: per micro-batch and pipeline stage (forward + backward):
            ``torch.distributed.pipelining``'s send/recv and schedule work; higher => fewer
            stages and micro-batches.
        step_overhead_us: per training step whatever the plan (the end-of-step
            synchronisation of the ranks).
        cores_per_host: CPU cores the ranks of one host share (may be fractional: the
            effective count measured by the calibration); 0 => one core per device, no
            sharing (accelerators, and every hand-written Cluster). Below
            ``devices_per_host`` => the compute fields are taken as measured with every
            rank busy, and a pipeline whose ranks idle in the bubble runs faster
            (:func:`~hexagram.parallel.inter.step_time`).
        dp_sync_scale: measured / priced seconds of the executor's bucketed gradient
            allreduce (:func:`~hexagram.parallel.dpsync.measure_dp_sync`, the model's own
            gradients on the job's ranks); multiplies the exact data-parallel sync's
            price. 1 => the alpha-beta price as is (every hand-written Cluster).
        zero_grad_collective: the collective ZeRO's gradient reduction runs as:
            ``"reduce_scatter"``, or ``"allreduce"`` where the executor reduces in place
            and keeps its slice (gloo: :class:`~hexagram.parallel.zero.InPlaceReduceScatter`,
            twice the bytes; the calibration sets it from the job's backend).
        dtype_bytes: bytes per element of parameters, gradients and activations.
        optimizer_bytes: optimizer state bytes per parameter (Adam fp32 master + m + v: 12).
        backend: whose collective schedules price the collectives
            (:data:`hexagram.cost.collectives.BACKENDS`): ``"gloo"`` rings (the default:
            what the calibration fits), ``"nccl"`` the faster of ring and tree.
    """

    hosts: int = 1
    devices_per_host: int = 8
    intra_host_gbps: float = 2400.0
    inter_host_gbps: float = 200.0
    device_memory_gb: float = 80.0
    device_tflops: float = 150.0
    memory_gbps: float = 1500.0
    intra_latency_us: float = 10.0
    inter_latency_us: float = 25.0
    op_overhead_us: float = 5.0
    tp_overhead_us: float = 0.0
    zero_overhead_us: float = 0.0
    microbatch_overhead_us: float = 0.0
    step_overhead_us: float = 0.0
    cores_per_host: float = 0.0
    dp_sync_scale: float = 1.0
    zero_grad_collective: str = "reduce_scatter"
    dtype_bytes: int = 2
    optimizer_bytes: int = 12
    backend: str = "gloo"

    def __post_init__(self) -> None:
        check_int(self, "hosts", low=1)
        check_int(self, "devices_per_host", low=1)
        if self.devices_per_host & (self.devices_per_host - 1):
            raise ConfigError(f"Cluster.devices_per_host must be a power of two (submeshes "
                              f"(1, 2^k) tile a host), got {self.devices_per_host}")
        for name in ("intra_host_gbps", "inter_host_gbps", "device_memory_gb", "device_tflops",
                     "memory_gbps", "dp_sync_scale"):
            check_float(self, name, low=0.0, low_open=True)
        for name in ("intra_latency_us", "inter_latency_us", "op_overhead_us", "tp_overhead_us",
                     "zero_overhead_us", "microbatch_overhead_us", "step_overhead_us"):
            check_float(self, name, low=0.0)
        check_float(self, "cores_per_host", low=0.0)
        if 0 < self.cores_per_host < 1:
            raise ConfigError(f"Cluster.cores_per_host must be 0 (one core per device) or at "
                              f"least 1, got {self.cores_per_host}")
        check_choice(self, "zero_grad_collective", ("reduce_scatter", "allreduce"))
        check_choice(self, "dtype_bytes", (1, 2, 4, 8))
        check_int(self, "optimizer_bytes", low=0)
        check_choice(self, "backend", BACKENDS)

        # the one description every price reads (a field-free attribute: not in ==, JSON)
        object.__setattr__(self, "_hardware", self._describe())

    def _describe(self) -> Hardware:
        """The link and device fields in the kernel's units (bytes/s, s, FLOP/s, bytes)."""
        return Hardware(
            hosts=self.hosts, devices_per_host=self.devices_per_host,
            intra=Link("intra-host", self.intra_host_gbps * 1e9 / 8,
                       self.intra_latency_us * 1e-6),
            inter=Link("inter-host", self.inter_host_gbps * 1e9 / 8,
                       self.inter_latency_us * 1e-6),
            device=Device("device", self.device_tflops * 1e12, self.memory_gbps * 1e9,
                          self.device_memory_gb * 1e9),
            efficiency=1.0, backend=self.backend)

    @property
    def hardware(self) -> Hardware:
        """This cluster's hosts, links and device as the cost model's one description (its
        figures in bytes/s, seconds, FLOP/s; the compute figure is achievable, so its
        efficiency is 1)."""
        return self._hardware  # type: ignore[attr-defined,no-any-return]

    @property
    def corrections(self) -> dict[str, Any]:
        """The fields that are not hardware: what the planner measures on top of the
        kernel's prices, and its dtype and optimizer (``from_hardware(c.hardware,
        **c.corrections)`` is ``c`` again, up to the units' rounding)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in _HARDWARE_FIELDS}

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def memory_bytes(self) -> float:
        return self.hardware.memory_bytes

    def sharing(self, busy: float) -> float:
        """How much slower each rank computes when ``busy`` ranks of a host compute at once
        (``busy / cores_per_host``, at least 1; always 1 with ``cores_per_host`` 0).

        Example:
            >>> c = Cluster(hosts=1, devices_per_host=4, cores_per_host=2)
            >>> c.sharing(4), c.sharing(3), c.sharing(1), Cluster().sharing(8)
            (2.0, 1.5, 1.0, 1.0)
        """
        return max(1.0, busy / self.cores_per_host) if self.cores_per_host else 1.0

    def link(self, inter: bool) -> tuple[float, float]:
        """(alpha seconds, bytes per second) of the inter-host or intra-host link."""
        hw = self.hardware
        if inter:
            return hw.inter.latency_s, hw.uplink_bps
        return hw.intra.latency_s, hw.intra.rate_bps

    def topology(self, ranks: int, per_host: int, uplink_share: int = 1) -> Topology:
        """``ranks`` of one collective, ``per_host`` of them on each host, on this cluster's
        links (:class:`hexagram.cost.collectives.Topology`, what the cost model prices
        collectives on); ``uplink_share`` collectives at once share each host's network.

        Example:
            >>> t = Cluster(hosts=2, devices_per_host=2).topology(4, 2)
            >>> t.hosts, t.per_host, t.inter_bps * 8 / 1e9
            (2, 2, 200.0)
        """
        return self.hardware.topology(ranks, per_host, uplink_share)

    def submeshes(self) -> list[Submesh]:
        """Alpa's submesh shapes: (1, 1), (1, 2), ..., (1, per_host), (2, per_host), ..."""
        out, k = [], 1
        while k < self.devices_per_host:
            out.append(Submesh(1, k))
            k *= 2
        out += [Submesh(n, self.devices_per_host) for n in range(1, self.hosts + 1)]
        return out

    def replace(self, **changes: Any) -> Cluster:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hardware(cls, hw: Hardware, *, hosts: int | None = None,
                      **fields: Any) -> Cluster:
        """The cluster of a hardware description (:class:`hexagram.cost.hardware.Hardware`,
        e.g. ``hexagram simulate``'s :meth:`hexagram.cost.simulate.Cluster.hardware`) with
        ``hosts`` hosts (default: ``hw.hosts``): its links (the uplink as ``links x rate /
        oversubscription``), backend and, where ``hw`` has a device, its achievable compute
        (peak x efficiency), memory bandwidth and size; other fields (the planner's
        corrections, or hardware fields to override) from ``fields``.

        Example:
            >>> from hexagram.cost.simulate import Cluster as Simulated
            >>> hw = Simulated(devices_per_host=8, inter="25gbe", inter_links=2,
            ...                device="h100").hardware()
            >>> c = Cluster.from_hardware(hw, hosts=4, dtype_bytes=4)
            >>> c.devices, c.inter_host_gbps, c.backend, c.dtype_bytes
            (32, 50.0, 'nccl', 4)
        """
        figures: dict[str, Any] = {
            "hosts": hw.hosts if hosts is None else hosts,
            "devices_per_host": hw.devices_per_host,
            "intra_host_gbps": hw.intra.rate_bps * 8 / 1e9,
            "intra_latency_us": hw.intra.latency_s * 1e6,
            "inter_host_gbps": hw.uplink_bps * 8 / 1e9,
            "inter_latency_us": hw.inter.latency_s * 1e6, "backend": hw.backend}
        if hw.device is not None:
            figures.update(device_tflops=hw.flops / 1e12, memory_gbps=hw.device.hbm_bps / 1e9,
                           device_memory_gb=hw.device.memory / 1e9)
        return cls(**{**figures, **fields})

    @classmethod
    def from_presets(cls, hosts: int, devices_per_host: int, *, intra: str, inter: str,
                     device: str | None = None, **fields: Any) -> Cluster:
        """A cluster of the cost model's presets (:mod:`hexagram.cost.devices`): the link
        inside a host and between hosts (``"nvlink"``, ``"25gbe"``, ``"100mbit"``, ...)
        and, with ``device``, its datasheet at the model's efficiency (other fields from
        ``fields``, the backend gloo unless given): the hardware ``hexagram simulate``
        describes, for the planner (:meth:`from_hardware` of
        :meth:`hexagram.cost.hardware.Hardware.from_presets`).

        Example:
            >>> c = Cluster.from_presets(2, 8, intra="nvlink", inter="25gbe", device="h100")
            >>> c.inter_host_gbps, c.inter_latency_us, c.device_memory_gb
            (25.0, 20.0, 80.0)
        """
        backend = fields.pop("backend", cls.__dataclass_fields__["backend"].default)
        hw = Hardware.from_presets(intra=intra, inter=inter, device=device, backend=backend)
        # the shape is checked by the planner's rules (a power of two per host)
        return cls.from_hardware(hw, hosts=hosts, devices_per_host=devices_per_host, **fields)

    @classmethod
    def parse(cls, text: str, **fields: Any) -> Cluster:
        """``"2x8"`` -> 2 hosts of 8 devices (other fields from ``fields``)."""
        try:
            hosts, per_host = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise ConfigError(f"cluster must look like HOSTSxDEVICES (e.g. 2x8), got "
                              f"{text!r}") from None
        return cls(hosts=hosts, devices_per_host=per_host, **fields)


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """Degrees to impose on the search (None: the planner chooses).

    Attributes:
        pp: pipeline stages; more => less memory per device, more bubbles.
        tp: tensor-parallel degree inside every stage; more => less memory, more collectives.
        dp: data-parallel degree inside every stage; more => more gradient traffic.
        microbatches: micro-batches per step; more => smaller bubbles, smaller matmuls.
        schedule: ``"1f1b"`` (activations of at most #stages micro-batches live) or
            ``"gpipe"`` (all micro-batches live).
        dp_algorithms: gradient algorithms a stage's data-parallel sync may use, one more
            choice per stage (:mod:`hexagram.parallel.relax`); the default, allreduce only,
            is exact. Adding lossy ones (``("allreduce", "fp16", "powersgd")``) lets the
            planner trade gradient fidelity for bytes on slow links.
        zero: whether the planner may ZeRO-shard parameters over a stage's ``dp`` ranks
            (FSDP2); False => every stage keeps whole parameters (e.g. to compare a plan
            with its unsharded twin).
    """

    pp: int | None = None
    tp: int | None = None
    dp: int | None = None
    microbatches: int | None = None
    schedule: str = "1f1b"
    dp_algorithms: tuple[str, ...] = ("allreduce",)
    zero: bool = True

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "dp", "microbatches"):
            if getattr(self, name) is not None:
                check_int(self, name, low=1)
        check_choice(self, "schedule", ("1f1b", "gpipe"))
        check_choice(self, "zero", (True, False))
        if tuple(self.dp_algorithms) != ("allreduce",):
            object.__setattr__(self, "dp_algorithms", check_priced(self.dp_algorithms))

    def validate(self, cluster: Cluster) -> None:
        """Degrees must multiply to (or divide) the cluster's devices; error names the field."""
        fixed = {k: v for k, v in (("pp", self.pp), ("tp", self.tp), ("dp", self.dp)) if v}
        prod = 1
        for v in fixed.values():
            prod *= v
        if len(fixed) == 3 and prod != cluster.devices:
            raise ConfigError(f"Constraints pp*tp*dp = {prod} but the cluster has "
                              f"{cluster.devices} devices; change pp, tp or dp")
        if cluster.devices % prod:
            raise ConfigError(f"Constraints {fixed} multiply to {prod}, which does not divide "
                              f"the cluster's {cluster.devices} devices")
        if self.tp and self.tp > cluster.devices_per_host:
            raise ConfigError(f"Constraints.tp={self.tp} exceeds Cluster.devices_per_host="
                              f"{cluster.devices_per_host}: tensor parallelism stays in a host")
