"""A stage's logical ``d x t`` mesh and the price of its collectives and operators.

``t`` groups consecutive devices (inside a host); ``d`` crosses hosts when
``spans_hosts``. A collective over an axis is priced by the cost model's kernel
(:mod:`hexagram.cost.collectives`) on the axis's ranks as they sit on the hosts: a ring
allreduce of ``X`` bytes over ``P`` ranks on ``H`` hosts costs ``2 (P-H)`` hops inside a
host and ``2 (H-1)`` across (latencies ``a``, ``e``) plus ``2 (P-1)/P X`` over the slower
link's rate; allgather and reduce-scatter half the hops and bytes (the cluster's
``backend`` picks the schedule: gloo rings, NCCL ring or tree).

Example:
    >>> from hexagram.parallel.cluster import Cluster
    >>> m = Mesh(cluster=Cluster(hosts=1, devices_per_host=8), d=2, t=4, b=4, microbatches=1)
    >>> round(m.collective("allreduce", "t", 1e6) * 1e6, 1)   # microseconds
    65.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hexagram.cost.collectives import Topology, collective_time
from hexagram.parallel.cluster import Cluster

__all__ = ["Mesh"]

@dataclass(frozen=True, kw_only=True)
class Mesh:
    """A logical ``d x t`` mesh of a stage, and the per-device micro-batch ``b`` (samples).

    ``t`` groups consecutive devices (inside a host); ``d`` crosses hosts when ``spans_hosts``.
    """

    cluster: Cluster
    d: int
    t: int
    b: float
    microbatches: int
    spans_hosts: bool = False
    #: gradient algorithm of the ``d`` sync (``hexagram.parallel.rules.PRICED``)
    dp_algorithm: str = "allreduce"
    #: its config (``relax_cost.frozen_options``); ``None``: the one the planner emits
    dp_options: tuple[tuple[str, Any], ...] | None = None
    #: whether parameters may be ZeRO-sharded over ``d`` (``Constraints.zero``)
    zero: bool = True

    def topology(self, axis: str) -> Topology:
        """The ranks of one collective over mesh axis ``"d"`` or ``"t"``, laid out on the
        hosts: ``t`` stays inside a host; ``d`` spans the stage's hosts when
        ``spans_hosts`` (``devices_per_host / t`` of its ranks on each host), its ``t``
        rings (one per tensor-parallel rank) sharing each host's network."""
        c = self.cluster
        if axis == "t" or not self.spans_hosts:
            n = self.t if axis == "t" else self.d
            return c.topology(n, math.gcd(n, c.devices_per_host))
        per_host = math.gcd(self.d, max(1, c.devices_per_host // self.t))
        return c.topology(self.d, per_host, min(self.t, c.devices_per_host))

    def collective(self, kind: str, axis: str, nbytes: float, count: float = 1.0) -> float:
        """Seconds of ``count`` collectives of ``nbytes`` in all (full tensors) over mesh axis
        ``"d"``/``"t"``: each pays the latency, the bytes are paid once. A fractional
        ``count`` is a tensor's share of a bucket's one collective. The price is the cost
        model's (:func:`hexagram.cost.collectives.collective_time` on :meth:`topology`,
        the cluster's backend)."""
        t = self.topology(axis)
        if t.world <= 1 or nbytes <= 0:
            return 0.0
        return collective_time(kind, nbytes, t, self.cluster.backend, count)

    def compute(self, flops: float, nbytes: float) -> float:
        """Forward + backward seconds of an operator (backward ~ 2x forward)."""
        c, hw = self.cluster, self.cluster.hardware
        return 3.0 * (c.op_overhead_us * 1e-6 + max(flops / hw.flops,
                                                     nbytes / hw.memory_bps))
