"""Network probe: the real collectives at a few sizes, fitted to latency + bytes / rate.

Each collective (``allreduce``, ``allgather``, ``alltoall``, ``p2p`` = both ring neighbours
at once, as the decentralized exchange) runs at three message sizes on every rank at once;
the third size is chosen from the first two so that it lasts about ``budget_s / 16``
(whatever the link: 10 Mbit/s or loopback). Each collective gets its own fit of the time
against the bytes *this rank sends* in it, so what the lab found, that several flows per
port (all-to-all, two-neighbour exchange) move fewer bytes per second than one ring flow,
is measured rather than assumed. With several ranks per host and several hosts, the
allreduce inside a host is fitted too (``intra``), for hierarchical allreduce.

CPU: the process CPU seconds of each run (all of its threads: gloo's, the kernel's work
done on its behalf) get their own fit per collective (:attr:`NetworkProfile.cpu`), and
:attr:`NetworkProfile.share` is how many ranks share each core of the busiest machine
(ranks of one machine found by its boot id). Where ranks share cores (``share > 1``, e.g.
emulated hosts on one box), the CPU that communication costs competes with compute, and
the model adds a CPU floor (:mod:`hexagram.cost.model`).

Ranks disagree when links differ: every rank fits its own timings, then the slowest rate
and largest latency of each collective are taken (allreduce MIN/MAX) and
:attr:`NetworkProfile.asymmetry` says by how much the fastest rank saw more.

Example:
    >>> fit = Fit(latency_s=0.001, rate_bps=12.5e6)   # 100 Mbit/s, 1 ms
    >>> round(fit.time(1_250_000), 4)
    0.101
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator
from hexagram.comm.device import control_zeros, group_device
from hexagram.cost.fit import Fit, fit_line
from hexagram.errors import HexagramError

__all__ = ["COLLECTIVES", "Fit", "NetworkProfile", "ProbeError", "exchange_fit", "fit_line",
           "probe"]

COLLECTIVES = ("allreduce", "allgather", "alltoall", "p2p")


class ProbeError(HexagramError):
    """The probe could not run its collectives (a peer unreachable, a timeout)."""


@dataclass
class NetworkProfile:
    """Fits per collective for ``world`` ranks on ``hosts`` hosts (see module doc)."""

    world: int
    hosts: int
    fits: dict[str, Fit]
    intra: Fit | None = None
    asymmetry: float = 1.0  # fastest rank's allreduce rate / slowest rank's
    seconds: float = 0.0  # how long the probe took
    notes: list[str] = field(default_factory=list)
    cpu: dict[str, Fit] = field(default_factory=dict)  # CPU seconds per collective
    share: float = 0.0  # ranks per core on the busiest machine (0: unknown, or GPUs)

    def fit(self, op: str) -> Fit:
        """The fit for a message kind; ``hierarchical`` and trees use allreduce / p2p;
        ``pair`` (gTop-k's rounds, one partner each way) is :func:`exchange_fit`."""
        if op == "pair":
            return exchange_fit(self.fits["allreduce"], self.fits["p2p"], self.world)
        key = {"hierarchical": "allreduce", "tree": "p2p"}.get(op, op)
        return self.fits[key]

    def cpu_fit(self, op: str) -> Fit | None:
        """The CPU fit of a message kind (None: not measured), mapped as :meth:`fit`."""
        if op == "pair":
            if "allreduce" not in self.cpu or "p2p" not in self.cpu:
                return None
            return exchange_fit(self.cpu["allreduce"], self.cpu["p2p"], self.world)
        return self.cpu.get({"hierarchical": "allreduce", "tree": "p2p"}.get(op, op))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "fits": {k: asdict(v) for k, v in self.fits.items()},
                "intra": None if self.intra is None else asdict(self.intra),
                "cpu": {k: asdict(v) for k, v in self.cpu.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NetworkProfile:
        return cls(data["world"], data["hosts"],
                   {k: Fit(**v) for k, v in data["fits"].items()},
                   None if data.get("intra") is None else Fit(**data["intra"]),
                   data.get("asymmetry", 1.0), data.get("seconds", 0.0),
                   list(data.get("notes", [])),
                   {k: Fit(**v) for k, v in data.get("cpu", {}).items()},
                   data.get("share", 0.0))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> NetworkProfile:
        """Read a probe file written by :meth:`save` (``hexagram advise --probe FILE``)."""
        return cls.from_json(json.loads(Path(path).read_text()))


def exchange_fit(ring: Fit, p2p: Fit, world: int) -> Fit:
    """A tree's exchange with one partner (gTop-k's rounds: each rank sends to and receives
    from one peer on the same connection): the two-neighbour exchange's rate per byte sent
    (``p2p``: data both ways on each connection, as here; the lab measured it at 55-60 %
    of the ring's rate, where each connection carries data one way), and the latency of
    one of the ring's ``2 (P-1)`` steps (a hop; the ``p2p`` fit's intercept is not one: at
    10 Mbit/s it was 20 ms against the ring's 0, from the line through sizes inside and
    outside the shaper's burst).

    >>> exchange_fit(Fit(0.006, 1e7), Fit(0.02, 6e6), 4)
    Fit(latency_s=0.001, rate_bps=6000000.0)
    """
    return Fit(ring.latency_s / max(1, 2 * (world - 1)), p2p.rate_bps)


def _op(comm: Communicator, name: str, numel: int) -> tuple[Callable[[], object], int]:
    """A runnable collective of ``4 numel`` bytes per rank and the bytes this rank sends.

    The buffers are raw bytes (``uint8``), as payloads are: the probe times the wire, and a
    byte buffer is valid on every backend (sums wrap around, which no one reads).
    """
    p, nbytes = comm.size, 4 * numel
    x = torch.ones(nbytes, dtype=torch.uint8, device=group_device(comm))
    if name == "allreduce":
        return (lambda: primitives.allreduce(comm, x, average=False).wait()), \
            2 * (p - 1) * nbytes // p
    if name == "allgather":
        return (lambda: _raw_allgather(comm, x)), (p - 1) * nbytes
    if name == "alltoall":
        n = nbytes - nbytes % p or p
        y, out = torch.ones_like(x[:n]), torch.empty_like(x[:n])
        return (lambda: _wait(dist.all_to_all_single(out, y, group=comm.group,
                                                     async_op=True), comm)), (p - 1) * n // p
    peers = sorted({(comm.rank + 1) % p, (comm.rank - 1) % p} - {comm.rank})
    return (lambda: primitives.neighbor_exchange(comm, x, peers, peers).wait()), \
        len(peers) * nbytes


def _wait(work: Any, comm: Communicator) -> None:
    work.wait(comm.timeout)


def _raw_allgather(comm: Communicator, x: torch.Tensor) -> None:
    out = [torch.empty_like(x) for _ in range(comm.size)]
    _wait(dist.all_gather(out, x, group=comm.group, async_op=True), comm)


def _timed(comm: Communicator, run: Callable[[], object], reps: int) -> tuple[float, float]:
    """Fastest of ``reps`` runs, each started together (a tiny allreduce first), and the
    process CPU seconds of that run."""
    best, cpu = float("inf"), 0.0
    for _ in range(reps):
        _sync(comm)
        t0, c0 = time.perf_counter(), time.process_time()
        run()
        took = time.perf_counter() - t0
        if took < best:
            best, cpu = took, time.process_time() - c0
    return best, cpu


def _sync(comm: Communicator) -> None:
    dist.all_reduce(control_zeros(1, comm), group=comm.group)


def _agree(comm: Communicator, value: float, op: Any) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=group_device(comm))
    dist.all_reduce(t, op=op, group=comm.group)
    return float(t.item())


def _probe_one(comm: Communicator, name: str, slot_s: float) -> tuple[Fit, Fit]:
    """Three sizes: 4 Ki and 64 Ki floats, then one sized to last about ``slot_s``; the
    fits of time and of process CPU seconds."""
    points, cpu = [], []
    for numel in (4096, 65536):
        run, sent = _op(comm, name, numel)
        took, used = _timed(comm, run, 2)
        points.append((float(sent), took))
        cpu.append((float(sent), used))
    rough = fit_line(points)
    big = rough.rate_bps * slot_s / max(points[1][0] / 65536, 1.0)
    numel = int(_agree(comm, min(max(big, 65536 * 4), 8 * 2**20), dist.ReduceOp.MIN))
    run, sent = _op(comm, name, numel)
    took, used = _timed(comm, run, 1)
    return fit_line([*points, (float(sent), took)]), fit_line([*cpu, (float(sent), used)])


def _share(comm: Communicator) -> float:
    """Ranks per usable core on the busiest machine (ranks grouped by the kernel's boot
    id); 0 on GPUs, where compute does not compete with communication for cores."""
    if group_device(comm).type != "cpu":
        return 0.0
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = os.uname().nodename
    key = torch.tensor([zlib.crc32(boot.encode())], dtype=torch.int64)
    keys = [torch.zeros_like(key) for _ in range(comm.size)]
    dist.all_gather(keys, key, group=comm.group)
    mine = sum(int(k.item() == key.item()) for k in keys)
    return _agree(comm, mine / max(1, len(os.sched_getaffinity(0))), dist.ReduceOp.MAX)


def probe(comm: Communicator, hosts: int = 1, budget_s: float = 4.0,
          intra: Communicator | None = None) -> NetworkProfile:
    """Measure and fit every collective on ``comm`` (collective: every rank calls it).

    Args:
        comm: the ranks to probe (a dedicated communicator keeps the bytes out of an
            algorithm's count).
        hosts: hosts the ranks are spread over (for the schedule of hierarchical allreduce).
        budget_s: the probe aims at this many seconds in all (about 3 at loopback speed,
            more on very slow links: the two small sizes are fixed).
        intra: communicator of this rank's host, to fit intra-host allreduce separately.

    Raises:
        ProbeError: a collective failed or timed out (names the collective and the fix).
    """
    t0 = time.perf_counter()
    fits: dict[str, Fit] = {}
    cpu: dict[str, Fit] = {}
    slot = budget_s / 16
    try:
        _sync(comm)
        for name in COLLECTIVES:
            fits[name], cpu[name] = _probe_one(comm, name, slot)
        intra_fit = _probe_one(intra, "allreduce", slot)[0] if intra is not None else None
        worst, asym = _worst_case(comm, fits)
        cpu_worst, _ = _worst_case(comm, cpu)
        share = _share(comm)
    except (RuntimeError, HexagramError) as exc:
        raise ProbeError(
            f"network probe failed on rank {comm.rank} of {comm.size} ({len(fits)} of "
            f"{len(COLLECTIVES)} collectives done): {exc}. A peer is unreachable or stopped: "
            "check that every rank runs and can open connections to the others "
            "(MASTER_ADDR, GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, firewalls)") from exc
    notes = []
    if asym > 1.3:
        notes.append(f"links differ across ranks (fastest allreduce rate {asym:.1f}x the "
                     "slowest): deciding on the slowest link")
    return NetworkProfile(comm.size, hosts, worst, intra_fit, asym,
                          time.perf_counter() - t0, notes, cpu_worst, share)


def _worst_case(comm: Communicator, fits: dict[str, Fit]) -> tuple[dict[str, Fit], float]:
    """Every rank's fits reduced to the slowest rate and largest latency per collective;
    also the allreduce rate spread (max / min over ranks)."""
    out = {}
    for name, f in fits.items():
        rate = _agree(comm, f.rate_bps, dist.ReduceOp.MIN)
        latency = _agree(comm, f.latency_s, dist.ReduceOp.MAX)
        out[name] = Fit(latency, rate)
    fastest = _agree(comm, fits["allreduce"].rate_bps, dist.ReduceOp.MAX)
    return out, fastest / max(out["allreduce"].rate_bps, 1e-9)
