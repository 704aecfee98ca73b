"""The one pricing kernel: step-time model of every algorithm from measured compute,
compressor and network profiles, and the collective prices the planner charges too.

- :mod:`hexagram.cost.facts`: the interface the model reads algorithms through (it imports
  none), and how a new compressor or algorithm declares what it is priced by;
- :mod:`hexagram.cost.hardware`: the one hardware description
  (:class:`~hexagram.cost.hardware.Hardware`: hosts, devices per host, the links inside and
  between hosts, uplinks, the device, the backend; from the presets of
  :mod:`hexagram.cost.devices` or measured), of which ``simulate``'s cluster
  (:mod:`hexagram.cost.cluster`) and the planner's
  :class:`~hexagram.parallel.cluster.Cluster` are views;
- :mod:`hexagram.cost.collectives`: the collective schedules (ring, tree, recursive
  doubling, hierarchical, all-to-all, neighbour exchange, gTop-k rounds) on a
  :class:`~hexagram.cost.collectives.Topology` (a collective's ranks laid on the hosts,
  :meth:`Hardware.topology <hexagram.cost.hardware.Hardware.topology>`): ``simulate``,
  ``advise`` and the planner's :class:`~hexagram.parallel.mesh.Mesh` price collectives there;
- :mod:`hexagram.cost.fit` and :mod:`hexagram.cost.stopwatch`: the one fit (latency +
  bytes / rate, a + b n) and the one stopwatch (interleaved turns) every measurement uses;
- :mod:`hexagram.cost.schedule`: the messages and wire bytes of one step, read off the
  algorithm's own objects (its compressor, config and declared protocol);
- :mod:`hexagram.cost.probe`: a short network probe with the real collectives, fitted per
  collective to latency + bytes / rate;
- :mod:`hexagram.cost.profile`: compute (forward, backward, when each gradient is ready)
  and compressor CPU cost, measured on the job;
- :mod:`hexagram.cost.model`: predicted step time with its parts, per algorithm.

``algorithm="auto"`` (:mod:`hexagram.auto.algorithm`) and ``hexagram advise`` read it.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hexagram.cost.schedule import Message, TensorSpec, layout_of, step_schedule, wire_bytes

__all__ = ["Message", "TensorSpec", "layout_of", "step_schedule", "wire_bytes"]


def __getattr__(name: str) -> Any:
    # The schedule imports torch and the compressors; the device and link presets and the
    # collective schedules (`hexagram simulate --help`) need neither.
    if name in __all__:
        from hexagram.cost import schedule

        return getattr(schedule, name)
    raise AttributeError(f"module 'hexagram.cost' has no attribute {name!r}")
