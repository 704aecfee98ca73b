"""A stage's logical ``d x t`` mesh and the price of its collectives and operators.

``t`` groups consecutive devices (inside a host); ``d`` crosses hosts when
``spans_hosts``. Collectives on ``n`` devices of a link with latency ``a`` and rate ``w``
bytes/s, ``X`` the full tensor size (ring algorithms):
    allreduce 2(n-1)a + 2(n-1)/n X/w;  allgather, reduce-scatter, all-to-all (n-1)a +
    (n-1)/n X/w;  send/recv a + X/w.

Example:
    >>> from hexagram.parallel.cluster import Cluster
    >>> m = Mesh(cluster=Cluster(hosts=1, devices_per_host=8), d=2, t=4, b=4, microbatches=1)
    >>> round(m.collective("allreduce", "t", 1e6) * 1e6, 1)   # microseconds
    65.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hexagram.parallel.cluster import Cluster

__all__ = ["Mesh"]

_FACTOR = {"allreduce": 2.0, "allgather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


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

    def _link(self, axis: str) -> tuple[float, float, int]:
        """(alpha, bytes/s per ring, ring size) of a mesh axis."""
        if axis == "t":
            return (*self.cluster.link(self.t > self.cluster.devices_per_host), self.t)
        alpha, rate = self.cluster.link(self.spans_hosts)
        # t data-parallel rings (one per tensor-parallel rank) share each host's NIC
        share = min(self.t, self.cluster.devices_per_host) if self.spans_hosts else 1
        return alpha, rate / share, self.d

    def collective(self, kind: str, axis: str, nbytes: float, count: float = 1.0) -> float:
        """Seconds of ``count`` collectives of ``nbytes`` in all (full tensors) over mesh axis
        ``"d"``/``"t"``: each pays the latency, the bytes are paid once. A fractional
        ``count`` is a tensor's share of a bucket's one collective."""
        alpha, rate, n = self._link(axis)
        if n <= 1 or nbytes <= 0:
            return 0.0
        f = _FACTOR[kind]
        return f * (n - 1) * alpha * count + f * (n - 1) / n * nbytes / rate

    def compute(self, flops: float, nbytes: float) -> float:
        """Forward + backward seconds of an operator (backward ~ 2x forward)."""
        c = self.cluster
        return 3.0 * (c.op_overhead_us * 1e-6 + max(flops / (c.device_tflops * 1e12),
                                                     nbytes / (c.memory_gbps * 1e9)))
