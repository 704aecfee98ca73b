"""``simulate`` by label: the registry's algorithms priced on clusters one does not have.

:func:`hexagram.cost.simulate.simulate` prices algorithm objects and imports none; this is
the same call with labels made by the registry
(:func:`hexagram.algorithms.labels.simulable`), what ``hexagram simulate`` runs.

Example:
    >>> from hexagram.cost.simulate import Cluster, params_compute
    >>> rows = simulate(["allreduce", "fp16"], [8, 64], params_compute(10_000_000),
    ...                 Cluster(devices_per_host=8, inter="25gbe"))
    >>> [(r.label, r.world) for r in rows]
    [('allreduce', 8), ('fp16', 8), ('allreduce', 64), ('fp16', 64)]
    >>> skip_reason("auto")
    'auto delegates to the algorithm it measures best; simulate the candidates'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hexagram.algorithms.labels import simulable
from hexagram.cost import simulate as cost_simulate
from hexagram.cost.devices import Device
from hexagram.cost.profile import CompressorCost, ComputeProfile
from hexagram.cost.simulate import Cluster, Row

__all__ = ["simulate", "skip_reason"]


def simulate(labels: Sequence[str], worlds: Sequence[int], compute: ComputeProfile,
             cluster: Cluster, dev: Device | None = None, bucket_mb: float = 25.0,
             costs: Mapping[str, CompressorCost] | None = None) -> list[Row]:
    """:func:`hexagram.cost.simulate.simulate` of the registered algorithms ``labels`` name.

    Raises:
        ConfigError: unknown algorithm or preset, a world size that is not whole hosts.
    """
    return cost_simulate.simulate(labels, worlds, compute, cluster, dev, bucket_mb, costs,
                                  make=simulable)


def skip_reason(label: str) -> str | None:
    """Why an algorithm cannot be simulated (``None``: it can).

    Raises:
        ConfigError: an unknown algorithm name.
    """
    made = simulable(label)
    return made if isinstance(made, str) else None
