"""What the cost model reads off an algorithm: the interface it prices through.

The step-time model (:mod:`~hexagram.cost.schedule`, :mod:`~hexagram.cost.model`,
:mod:`~hexagram.cost.own_work`, :mod:`~hexagram.cost.measure`,
:mod:`~hexagram.cost.simulate`) never imports an algorithm module or the registry: it
prices any object that has the members of :class:`Priced`. Every
:class:`hexagram.algorithms.base.Algorithm` has them (the base class gives the defaults of
an algorithm that sends its compressor's payloads the generic way), and a compressor is
priced through :class:`hexagram.compress.base.Compressor`, which lives below the cost model.

How a new compressor or algorithm declares its facts
----------------------------------------------------

A compressor (its own file in ``hexagram/compress/`` plus one line in
``hexagram.compress._ENTRIES``) declares, as class attributes and one method:

- ``name``, ``aggregation`` (``SUM`` / ``GATHER`` / ``SCATTER_GATHER``) and
  ``payload_sums_elementwise``: which collective carries its payloads (the schedule);
- ``wire_layout(shape, dtype)``: shape and dtype of each tensor ``compress`` returns, from
  the config alone (the simulator's payload size; ``None`` makes callers compress);
- ``memory_passes``: passes over a 4-byte element its encode + decode make (the planner).

``tests/test_cost_payload_size.py`` (add the compressor's configurations to ``CONFIGS``)
and ``tests/test_cost_facts.py`` check the layout against real payloads.

A gradient algorithm that sends its compressor's payloads as the compressor's aggregation
says declares nothing beyond the public fields the model reads: ``compressor`` and
``error_feedback`` attributes, config fields ``granularity`` (``"layer"``/``"bucket"``),
``start_iter`` (full-precision warm-up steps), ``hierarchical``, ``on_nonfinite`` and
``density_at(step)`` where the density ramps. One with a protocol of its own overrides
these :class:`~hexagram.algorithms.base.Algorithm` members (all optional):

- ``wire_messages(bucket, world, rank)``: the :class:`~hexagram.cost.schedule.Message` s of
  one bucket after any warm-up (gTop-k's tree, random-k's shared positions, QAdam's
  momentum, robust shards); build them with :func:`~hexagram.cost.schedule.payload_of`,
  :func:`~hexagram.cost.schedule.ring_sent` and :func:`~hexagram.cost.schedule.segment_shapes`;
- ``step_messages(world, rank)``: messages of its own sent once per step, after the last
  bucket's (gTop-k's agreement on the faults of the messages its ranks received); read
  where present, as ``passes_nonfinite``, so an object without it sends none;
- ``own_work`` (``"tree"``: its measured own work replaces the decodes; ``"momentum"``:
  it adds around the encode and decode) with ``own_work_cost(sizes, device)`` timing it;
- ``gathered_decodes(world)``: payloads decoded per segment of a gathered format;
- ``granularity``: ``"bucket"`` if it encodes whole buckets whatever its config says;
- ``priced_as()``: a wrapper that sends another algorithm's messages returns that one;
- weight algorithms: ``kind = "weight"``, config ``period``/``interval``, and
  ``exchange_overlap`` (``"forward"``: hidden behind the forward pass; ``"background"``).

Whether ``auto`` may pick an algorithm, and whether the planner prices it, each at which
config, are registry declarations (``hexagram.algorithms.registry.Entry``'s ``auto`` and
``planner``), since they concern the name, not one instance. ``tests/test_cost_facts.py``
proves every registered algorithm priced (a schedule or an amortized step at several sizes).

Porting from the side tables this replaces: a rule in ``cost/payload_size.RULES`` becomes
the compressor's ``wire_layout`` (same formula, ``n = math.prod(shape)``); an entry of
``cost/schedule.CUSTOM`` becomes the algorithm's ``wire_messages`` (the same body with
``self`` for ``algorithm``; it is called after the warm-up and ``world <= 1`` checks); of
``cost/own_work.OWN_WORK`` its ``own_work`` and ``own_work_cost``; a name tested in
``cost/model`` (``"gtopk"``, ``"qadam"``, ``"decentralized"``, ``"async"``) its
``own_work``, ``granularity``, ``gathered_decodes`` or ``exchange_overlap``; a label in
``auto/choose.DEFAULT``/``DELAYED`` its entry's ``auto=Candidacy((label, ...),
delayed=...)``; a name in ``parallel/relax_cost.PRICED`` (with its ``PLANNED_OPTIONS``)
``planner=Planned(options)`` on its entry, and its ``_PASSES`` figure the compressor's
``memory_passes``.

Example:
    >>> import hexagram as hx
    >>> a: Priced = hx.algorithms.get("topk")
    >>> compressor_of(a).name, a.priced_as() is a
    ('topk', True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hexagram.compress.base import Compressor

__all__ = ["Message", "Priced", "Shapes", "TensorSpec", "TreeCost", "compressor_of"]

Shapes = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class TensorSpec:
    """A communicated tensor: its name, shape and element size in bytes."""

    name: str
    shape: tuple[int, ...]
    itemsize: int = 4

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Message:
    """One collective of a step: ``op`` is the collective's kind (``allreduce``,
    ``allgather``, ``alltoall``, ``p2p``, ``hierarchical``), ``sent`` the bytes this rank
    sends in it, ``rounds`` the sequential latency-bound rounds it takes (trees)."""

    op: str
    sent: int
    rounds: int = 1


@dataclass(frozen=True)
class TreeCost:
    """CPU seconds of an algorithm's own work on one segment of ``n`` elements, outside
    the compressor. gTop-k's tree (:func:`hexagram.cost.own_work.gtopk_tree_cost`):
    ``once`` (``a + b n``: this rank's pairs sorted, the result written into the segment)
    and ``per_round`` (``a + b n``: a round's pack, unpack, merge and survival check).
    QAdam (:func:`hexagram.cost.own_work.qadam_own_cost`): ``once`` turns the gradient into
    the preconditioned momentum before the encode, ``per_round`` (one round) turns the
    exchanged momentum back into a gradient.

    >>> round(TreeCost((1e-3, 1e-9), (2e-3, 1e-8)).seconds(10**6, 2), 6)  # 2 + 2 * 12 ms
    0.026
    """

    once: tuple[float, float]
    per_round: tuple[float, float]

    def seconds(self, n: int, rounds: int) -> float:
        """``once(n) + rounds * per_round(n)``."""
        return (self.once[0] + self.once[1] * n
                + rounds * (self.per_round[0] + self.per_round[1] * n))




class Priced(Protocol):
    """An algorithm as the cost model reads it (see the module doc for each member)."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...  # "grad" or "weight"

    @property
    def config(self) -> Any: ...

    @property
    def own_work(self) -> str: ...

    @property
    def exchange_overlap(self) -> str: ...

    @property
    def granularity(self) -> str: ...

    def priced_as(self) -> Priced: ...

    def wire_messages(self, bucket: Sequence[TensorSpec], world: int, rank: int
                      ) -> list[Message] | None: ...

    def own_work_cost(self, sizes: Shapes, device: torch.device | str = "cpu"
                      ) -> TreeCost | None: ...

    def gathered_decodes(self, world: int) -> int: ...


def compressor_of(algorithm: Any) -> Compressor | None:
    """The compressor ``algorithm`` sends through (its public ``compressor`` field), if any."""
    comp = getattr(algorithm, "compressor", None)
    return comp if isinstance(comp, Compressor) else None

