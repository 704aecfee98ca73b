"""The simulator against the network lab: predict a recorded ``hexagram bench`` row.

A lab run (``hexagram bench``: emulated hosts, gloo over TCP, links shaped by ``tc``) is a
cluster of ``hosts x ranks_per_host`` with the shaped rate between hosts and loopback inside
(:data:`LOOPBACK`, an assumption), running gloo's ring schedules. Its compute is the
worker's *measured* local step (forward + backward + update without communication), split
1 : 2 between forward and backward with gradients ready in proportion to the parameters
passed. A lossy algorithm's compression CPU is what the run measured beyond the local step
(user CPU per step minus the local step; kernel time is the network stack, not
compression), charged as encoding on the training thread. All ranks of a lab share one
machine's ``cores``: with more ranks than cores, CPU seconds stretch by ``ranks / cores`` of
wall time (the recorded runs: 4 ranks on 2 cores).

Example:
    >>> rec = LabRecord(hosts=4, bandwidth="100mbit", label="allreduce", measured_s=5.562,
    ...                 local_s=0.065, params=10_500_000)
    >>> round(predict_record(rec).step_s, 1)   # 63 MB at 100 Mbit/s; compute mostly overlaps
    5.1
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from hexagram.auto.simulate import simulate
from hexagram.cost.profile import CompressorCost, ComputeProfile
from hexagram.cost.schedule import TensorSpec
from hexagram.cost.simulate import Cluster, Row, reference_tensors

__all__ = ["LOOPBACK", "LabRecord", "compare", "lab_compute", "predict_record", "same_config"]

#: the rate between two ranks on one emulated host (loopback TCP): an assumption
LOOPBACK = "10gbit"


@dataclass(frozen=True, kw_only=True)
class LabRecord:
    """One algorithm's row of a lab run: its setting, measured mean step and CPU."""

    hosts: int
    bandwidth: str  # tc rate between hosts, e.g. "100mbit"
    label: str  # algorithm label as simulate takes it, e.g. "powersgd:start_iter=0"
    measured_s: float  # mean step of the slowest rank
    local_s: float  # measured local step (no communication)
    extra_cpu_s: float = 0.0  # user CPU per step beyond the local step
    ranks_per_host: int = 1
    model: str = "mlp"
    params: int = 10_500_000
    layers: int = 3
    batch: int = 32
    cores: int = 2  # the machine's cores, shared by every rank of the lab
    reported_mb: float | None = None  # MB/step the run's bytes_sent() reported

    @property
    def cpu_stretch(self) -> float:
        """Wall seconds per CPU second of one rank: ``ranks / cores`` when oversubscribed."""
        return max(1.0, self.hosts * self.ranks_per_host / self.cores)


@cache
def _tensors(model: str, params: int, layers: int) -> tuple[TensorSpec, ...]:
    return tuple(reference_tensors(model, params, layers)[0])


def lab_compute(tensors: Sequence[TensorSpec], local_s: float) -> ComputeProfile:
    """A measured local step as a compute profile (module doc)."""
    n = sum(t.numel for t in tensors)
    backward, ready, done = 2 * local_s / 3, [], 0
    for t in tensors:
        done += t.numel
        ready.append(backward * done / n)
    return ComputeProfile(local_s / 3, backward, 0.0, list(tensors), ready)


def predict_record(rec: LabRecord) -> Row:
    """The simulator's row for ``rec``'s setting (gloo rings, the measured compute)."""
    tensors = _tensors(rec.model, rec.params, rec.layers)
    n = sum(t.numel for t in tensors)
    stretch = rec.cpu_stretch
    cost = CompressorCost((0.0, max(0.0, rec.extra_cpu_s) * stretch / n), (0.0, 0.0))
    cluster = Cluster(devices_per_host=rec.ranks_per_host, intra=LOOPBACK,
                      inter=rec.bandwidth, backend="gloo")
    return simulate([rec.label], [rec.hosts * rec.ranks_per_host],
                    lab_compute(tensors, rec.local_s * stretch), cluster, None,
                    costs={rec.label: cost})[0]


def same_config(rec: LabRecord, row: Row) -> bool:
    """The prediction's bytes are the run's (within 2 %): the algorithm's configuration then
    is today's (a registry default changed since a run shows up here)."""
    return rec.reported_mb is None or abs(row.bytes / 1e6 / rec.reported_mb - 1) <= 0.02


def compare(records: Sequence[LabRecord]) -> tuple[list[tuple[LabRecord, Row, float]], float]:
    """Each record with its prediction and signed relative error ``pred / measured - 1``,
    and the median absolute error. Rows the simulator skips, and rows whose configuration
    is no longer today's (:func:`same_config`), are left out."""
    out = []
    for rec in records:
        row = predict_record(rec)
        if row.step_s is not None and same_config(rec, row):
            out.append((rec, row, row.step_s / rec.measured_s - 1))
    median = statistics.median(abs(e) for _, _, e in out) if out else float("nan")
    return out, median
