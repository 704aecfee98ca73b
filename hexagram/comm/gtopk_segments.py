"""gTopKAllReduce of many tensors at once: each keeps its own global top-k, one message per edge.

A bucket of ``T`` tensors, each with its own ``k_t`` pairs, used to run ``T`` trees, so a
step's messages, merges and host work grew with the number of tensors. Here the pairs of
every tensor travel together: indices are *bucket positions* (``offset_t + i``), so one
sort by index lays the pairs out tensor by tensor, and each round sends one buffer of
``K = sum k_t`` pairs (the same bytes as the ``T`` messages together). The merge keeps the
per-tensor semantics exactly: after a merge's stable sort by position, tensor ``t``'s
``2 k_t`` candidates (``k_t`` from each side, duplicates included) lie in one fixed block,
so a stable sort by magnitude followed by a stable sort by tensor ranks each tensor's
candidates on their own (largest first, ties to the lower index), and the first ``k_t`` of
each block are kept: a fixed set of positions, known on the host. Each tensor's kept pairs
are those :func:`hexagram.comm.gtopk.merge_topk` keeps for it alone (ties: the lower index,
as the device merge), with the same sums ``(0.0 + a) + b``.

No host reads: every size is known from the ``k_t`` (a :class:`SegmentPlan`, built once per
bucket layout, caches its device tables), and every message a rank receives is checked on
the device (each tensor's ``k_t`` pairs inside its own range, :meth:`SegmentPlan.bounds`,
in increasing order; :class:`~hexagram.comm.gtopk_tree.Receipts`).

Example:
    >>> plan = SegmentPlan.of(lengths=[4, 3], ks=[1, 2])
    >>> v, i = merge_segments(torch.tensor([5., 1., 2.]), torch.tensor([0, 4, 6]),
    ...                       torch.tensor([-6., 3., -1.]), torch.tensor([2, 5, 6]), plan)
    >>> i.tolist(), v.tolist()  # the second tensor: 6 sums to 1.0, tied with 4: 4 kept
    ([2, 4, 5], [-6.0, 1.0, 3.0])
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.gtopk import FlagSink, _check, _unused, start_tracked
from hexagram.comm.gtopk_tree import StepFaults

__all__ = ["SegmentPlan", "gtopk_allreduce_segments", "merge_segments"]


@dataclass(frozen=True, eq=False)
class SegmentPlan:
    """Tensors laid end to end (``lengths``), each keeping ``ks[t]`` pairs; host facts
    only, with the device tables derived from them cached per device.

    Attributes:
        lengths: elements of each tensor (each >= 1).
        ks: pairs each tensor keeps (``1 <= ks[t] <= lengths[t]``).
        starts: bucket position of each tensor's first element.
        numel: all elements, ``sum(lengths)`` (below 2**31: int32 positions).
        total: all pairs, ``sum(ks)``.
    """

    lengths: tuple[int, ...]
    ks: tuple[int, ...]
    starts: tuple[int, ...]
    numel: int
    total: int
    _tables: dict[tuple[str, str], Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, lengths: Sequence[int], ks: Sequence[int]) -> SegmentPlan:
        """The plan of tensors of ``lengths`` keeping ``ks`` pairs each.

        Raises ValueError for mismatched lists, a ``k`` outside ``[1, length]`` or a total
        of 2**31 elements or more (positions travel as int32).
        """
        lens, kept = tuple(int(n) for n in lengths), tuple(int(k) for k in ks)
        if not lens or len(lens) != len(kept) or any(
                not 1 <= k <= n for n, k in zip(lens, kept)):
            raise ValueError(f"SegmentPlan needs one k in [1, length] per tensor, got "
                             f"lengths {list(lens)[:8]} and ks {list(kept)[:8]}")
        if sum(lens) >= 2**31:
            raise ValueError(f"gtopk sends int32 positions; {sum(lens)} elements is too many "
                             "for one message: use smaller buckets")
        starts = tuple(itertools.accumulate((0, *lens[:-1])))
        return cls(lens, kept, starts, sum(lens), sum(kept))

    def _table(self, what: str, device: torch.device, make: Callable[[], Tensor]) -> Tensor:
        key = (what, str(device))
        if key not in self._tables:
            self._tables[key] = make()
        return self._tables[key]

    def _per_pair(self, what: str, per_tensor: Sequence[int], times: int,
                  device: torch.device) -> Tensor:
        """(times * total,) int64: ``per_tensor[t]`` repeated ``times * ks[t]`` times."""
        return self._table(what, device, lambda: torch.repeat_interleave(
            torch.tensor(per_tensor, dtype=torch.int64, device=device),
            torch.tensor(self.ks, dtype=torch.int64, device=device) * times))

    def candidate_tensor(self, device: torch.device) -> Tensor:
        """(2 total,): the tensor of each candidate of a merge, in position order."""
        return self._per_pair("tensor", range(len(self.ks)), 2, device)

    def heads(self, device: torch.device) -> Tensor:
        """(total,): the first ``ks[t]`` slots of each tensor's block of ``2 ks[t]``
        (pair ``j`` of tensor ``t`` sits at ``j - K_t`` in a block starting at ``2 K_t``,
        ``K_t`` the pairs before tensor ``t``: slot ``j + K_t``)."""
        before = list(itertools.accumulate((0, *self.ks[:-1])))
        return self._table("heads", device, lambda: torch.arange(
            self.total, device=device) + self._per_pair("before", before, 1, device))

    def bounds(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(lo, hi), (total,) each: the range ``[lo, hi)`` of each pair's position in a
        message (in position order: ``ks[t]`` pairs of tensor ``t``)."""
        lo = self._per_pair("lo", self.starts, 1, device)
        hi = self._per_pair("hi", [s + n for s, n in zip(self.starts, self.lengths)], 1,
                            device)
        return lo, hi

    def fallback(self, device: torch.device) -> Tensor:
        """(total,): valid, distinct positions in position order (each tensor's first
        ``ks[t]`` elements): what a malformed message's positions become."""
        before = list(itertools.accumulate((0, *self.ks[:-1])))
        return self._table("fallback", device, lambda: torch.arange(
            self.total, device=device) - self._per_pair("before", before, 1, device)
            + self.bounds(device)[0])

    def misplaced(self, indices: Tensor) -> Tensor:
        """0-d bool: ``indices`` (a result, in position order: ``ks[t]`` per tensor) are
        not each inside their tensor's range (a peer's bytes: one pass, no host read)."""
        lo, hi = self.bounds(indices.device)
        return ((indices < lo) | (indices >= hi)).any()


def merge_segments(values_a: Tensor, indices_a: Tensor, values_b: Tensor, indices_b: Tensor,
                   plan: SegmentPlan) -> tuple[Tensor, Tensor]:
    """Per tensor of ``plan``, :func:`hexagram.comm.gtopk.merge_topk` of its pairs in ``a``
    and in ``b`` (bucket positions, ``ks[t]`` of tensor ``t`` on each side, distinct within
    a side), all tensors at once in a fixed number of ops. Returns (values (total,),
    indices (total,) int64) in position order; ties of magnitude go to the lower index."""
    idx = torch.cat([indices_a.long(), indices_b.long()])
    s_idx, order = torch.sort(idx, stable=True)  # tensor t's candidates: one fixed block
    s_val = torch.cat([values_a, values_b]).index_select(0, order) + 0.0  # -0.0 -> +0.0
    repeat = s_idx[1:] == s_idx[:-1]  # a repeat of the previous index (same tensor)
    partner = torch.where(repeat, s_val[1:], torch.zeros_like(s_val[1:]))
    summed = torch.cat([s_val[:-1] + partner, s_val[-1:]])
    first = torch.cat([repeat.new_ones(1), ~repeat])
    magnitude = torch.where(first, summed.abs(), torch.full_like(summed, -1.0))
    by_size = torch.sort(magnitude, descending=True, stable=True).indices
    tensor_of = plan.candidate_tensor(idx.device).index_select(0, by_size)
    ranked = by_size.index_select(0, torch.sort(tensor_of, stable=True).indices)
    keep = torch.sort(ranked.index_select(0, plan.heads(idx.device))).values
    return summed.index_select(0, keep), s_idx.index_select(0, keep)


def gtopk_allreduce_segments(comm: Communicator, values: Tensor, indices: Tensor,
                             plan: SegmentPlan, checks: FlagSink | None = None,
                             step: StepFaults | None = None
                             ) -> Handle[tuple[Tensor, Tensor, Tensor]]:
    """:func:`hexagram.comm.gtopk.gtopk_allreduce_tracked` of every tensor of ``plan`` at
    once: ``values``/``indices`` hold ``ks[t]`` pairs of each tensor ``t`` (bucket
    positions, any order); each tensor gets its own global top-``ks[t]``, and every round
    sends one message of ``plan.total`` pairs (the bytes of the per-tensor messages).
    ``checks`` and ``step`` as there.

    Returns:
        Handle of (values (total,), indices (total,) int64 in position order: ``ks[t]``
        per tensor, included (total,) bool over the caller's ``indices``).

    Example:
        >>> gv, gi, mine = gtopk_allreduce_segments(comm, v, i, plan).wait()  # doctest: +SKIP
    """
    if values.numel() != plan.total:
        raise ValueError(f"gtopk: {values.numel()} pairs for a plan of {plan.total}")
    _check(values, indices, plan.numel, checks if comm.size > 1 else _unused)
    return start_tracked(comm, values, indices,
                         lambda va, ia, vb, ib: merge_segments(va, ia, vb, ib, plan),
                         bounds=plan.bounds, fallback=plan.fallback, faults=checks,
                         what=f"a bucket of {len(plan.ks)} tensor(s), {plan.numel} elements",
                         step=step)
