"""gTopKAllReduce (Shi et al., ICDCS 2019): the global top-k of a sparse sum on a tree.

Every rank holds ``k`` (value, index) pairs of a vector of ``numel`` elements. Instead of
gathering all ``k P`` pairs (O(kP) bytes per rank, as top-k by allgather does), ranks reduce
on a binomial tree: in round ``d = 1, 2, 4, ...`` rank ``r`` with ``r % 2d == d`` sends its
``k`` pairs to ``r - d``, which merges them with its own (summing values of shared indices)
and keeps the ``k`` of largest magnitude. After ``ceil(log2 P)`` rounds rank 0 holds the
global top-k and sends it back down the same tree. Any world size works (a rank whose
partner ``r + d`` does not exist just skips that round).

Every rank ends with the *same* ``k`` pairs (they come from rank 0), so the result is
identical everywhere by construction. Each rank sends ``k`` pairs once on the way up (except
rank 0) and ``k`` pairs to each of its tree children on the way down: ``2 (P-1)`` messages of
``k`` pairs in all, against ``P (P-1)`` for the allgather.

When P is a power of two the same reduction runs as recursive doubling instead: in round
``d = 1, 2, 4, ...`` ranks ``r`` and ``r ^ d`` exchange their ``k`` pairs and *both* merge.
After ``log2 P`` rounds every rank holds ``merge(merge(A_0, A_1), merge(A_2, A_3))``...,
exactly the tree's result at rank 0, bit for bit (``merge_topk`` is symmetric: it sums in
float, whose addition commutes, over the sorted union of indices, and selects from that
identical vector). The critical path halves, ``log2 P`` messages instead of ``2 log2 P``
(each waits for the merge before it), for ``P log2 P`` messages in all: every rank sends
``log2 P`` of them, as many as the tree's busiest rank.

Error feedback needs to know which of a rank's own pairs the result includes: an index can
win globally while this rank's value for it was dropped in an early merge.
:func:`gtopk_allreduce_tracked` says so exactly, at no extra bytes (recursive doubling: a
pair is included when it survived every merge; the tree: each parent flags, in the sign bit
of the indices it sends down, where the result includes that child's value).

Pairs travel as one uint8 buffer: ``k`` values in their own dtype, then ``k`` int32 indices
(tensors of up to 2**31 elements). A gloo group sends CUDA tensors through host memory,
staged by the helper behind :func:`hexagram.comm.primitives.neighbor_exchange` (gloo's
point-to-point ops read host memory only).

Received pairs are not trusted: each message is checked on the device, a malformed one is
merged as harmless pairs, and the ranks agree on the fault with one 8-byte allreduce: at
the end of the exchange, or, in a training step, once after the step's last exchange
(``step``: :class:`~hexagram.comm.gtopk_tree.StepFaults`), so every rank raises the same
:class:`~hexagram.errors.MalformedPayloadError` at the same step, naming the sender.

No host reads on the device path: every size is known on the host (``k`` pairs in, ``k``
out), merges sort and select fixed-size buffers, and the range check of the caller's
indices and the fault of the messages received are device flags handed to the caller's
once-per-step read (``checks``). The CPU-only numpy merges
(:func:`~hexagram.compress.packing.cpu_fast`) read freely.

Example:
    >>> h = gtopk_allreduce(comm, values, indices, numel=1000)   # doctest: +SKIP
    >>> gvalues, gindices = h.wait()                              # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.gtopk_tree import (  # noqa: F401 (re-exported: tests, cost model)
    Bounds,
    Merge,
    Merger,
    Receipts,
    StepFaults,
    _broadcast_down_tracked,
    _included,
    _isin,
    _pack,
    _recursive_doubling,
    _reduce_up_tracked,
    _survived,
    _unpack,
    exchange_works,
    tree_children,
    tree_parent,
)
from hexagram.compress.base import Payload
from hexagram.compress.packing import cpu_fast
from hexagram.errors import MalformedPayloadError

__all__ = ["FlagSink", "butterfly", "gtopk_allreduce", "gtopk_allreduce_tracked",
           "gtopk_bytes", "merge_topk", "out_of_range", "sparse_pairs", "tree_children",
           "tree_parent"]

#: where a device-side condition goes to be read with the step's other checks: called with
#: a 0-d bool tensor (True: a problem) and the function that explains it
#: (:meth:`hexagram.algorithms.finite.StepChecks.add` is one)
FlagSink = Callable[[Tensor, Callable[[], str]], None]


def sparse_pairs(payload: Payload) -> tuple[Tensor, Tensor]:
    """(values (k,), indices (k,)) of a sparsifier's payload: its float and integer tensors."""
    values = [t for t in payload.tensors if t.is_floating_point()]
    indices = [t for t in payload.tensors if not t.is_floating_point()]
    if len(values) != 1 or len(indices) != 1 or values[0].numel() != indices[0].numel():
        raise TypeError("gtopk needs a sparsifier payload of one value and one index tensor "
                        f"of equal length, got {[tuple(t.shape) for t in payload.tensors]}")
    return values[0].reshape(-1), indices[0].reshape(-1).long()


def butterfly(size: int) -> bool:
    """True when ``size`` ranks reduce by recursive doubling (a power of two, >= 2)."""
    return size >= 2 and size & (size - 1) == 0


def gtopk_bytes(rank: int, size: int, k: int, value_bytes: int = 4) -> tuple[int, int]:
    """(bytes sent going up, bytes sent going down) by ``rank`` for ``k`` pairs.

    One pair is ``value_bytes`` plus a 4-byte int32 index. With :func:`butterfly` sizes
    every round's exchange counts as going up: ``(log2 P pairs, 0)``.
    """
    pair = k * (value_bytes + 4)
    if butterfly(size):
        return pair * (size.bit_length() - 1), 0
    up = 0 if rank == 0 else pair
    return up, pair * len(tree_children(rank, size))


def merge_topk(values_a: Tensor, indices_a: Tensor, values_b: Tensor, indices_b: Tensor,
               k: int) -> tuple[Tensor, Tensor]:
    """Sum two sparse vectors (values at indices) and keep the ``k`` largest magnitudes.

    Indices within each input are unique. Returns (values (k,), indices (k,) int64), the
    indices in increasing order. The sums are those of a dense ``0.0 + a + b`` and the
    selection a top-k over the sorted union, so the result is symmetric in ``a`` and ``b``
    and bit-exact with any other order of the same inputs.

    On CPU, inputs already sorted by index (every output of this function) merge in linear
    time: a stable sort of the two concatenated runs (numpy's timsort merges them), no
    ``unique``. Unsorted inputs are sorted first.

    Example:
        >>> v, i = merge_topk(torch.tensor([5., -2.]), torch.tensor([0, 3]),
        ...                   torch.tensor([-4., 3.]), torch.tensor([0, 9]), k=2)
        >>> i.tolist(), v.tolist()
        ([3, 9], [-2.0, 3.0])
    """
    idx = torch.cat([indices_a.long(), indices_b.long()])
    val = torch.cat([values_a, values_b])
    if cpu_fast(idx) and val.dtype in (torch.float32, torch.float64):
        return _merge_cpu(val, idx, k)
    if k <= max(indices_a.numel(), indices_b.numel()):  # the union holds at least k
        return _merge_fixed(val, idx, k)
    uniq, inverse = torch.unique(idx, return_inverse=True)  # sized by the data: a host read
    summed = torch.zeros(uniq.numel(), dtype=val.dtype, device=val.device)
    summed.index_add_(0, inverse, val)
    keep = torch.topk(summed.abs(), min(k, uniq.numel()), sorted=False).indices.sort().values
    return summed[keep], uniq[keep]  # the kept positions in index order: the output is sorted


def _merge_fixed(val: Tensor, idx: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """:func:`merge_topk` of the concatenated pairs in buffers of known size (no host read),
    for ``k`` at most the union's size. A stable sort by index puts a shared index's two
    values side by side; the first of the two takes the sum ``(0.0 + a) + b`` (as
    ``index_add_`` into zeros gives), the second is ruled out of the selection; the ``k``
    largest magnitudes are taken by a stable sort (ties: the lower index first), then put
    back in index order.
    """
    s_idx, order = torch.sort(idx, stable=True)
    s_val = val.index_select(0, order) + 0.0  # -0.0 sums to +0.0
    repeat = s_idx[1:] == s_idx[:-1]  # (2k - 1,): a repeat of the previous index
    partner = torch.where(repeat, s_val[1:], torch.zeros_like(s_val[1:]))
    summed = torch.cat([s_val[:-1] + partner, s_val[-1:]])
    first = torch.cat([repeat.new_ones(1), ~repeat])
    magnitude = torch.where(first, summed.abs(), torch.full_like(summed, -1.0))
    top = torch.sort(magnitude, descending=True, stable=True).indices[:k]
    keep = torch.sort(top).values
    return summed.index_select(0, keep), s_idx.index_select(0, keep)


def _merge_cpu(val: Tensor, idx: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """:func:`merge_topk` of the concatenated lists in numpy (torch's CPU gathers and
    boolean selections are several times slower at k = 25K). A stable sort puts a shared
    index's ``a`` value first, so sums are ``(0.0 + a) + b`` as ``index_add_`` gives."""
    i, v = idx.numpy(), val.numpy()
    order = np.argsort(i, kind="stable")  # timsort: two sorted runs merge in linear time
    s_idx, s_val = i[order], v[order] + v.dtype.type(0.0)  # -0.0 sums to +0.0
    first = np.ones(s_idx.size, dtype=bool)
    np.not_equal(s_idx[1:], s_idx[:-1], out=first[1:])  # each index occurs at most twice
    second = np.flatnonzero(~first)
    s_val[second - 1] += s_val[second]
    uniq, summed = s_idx[first], s_val[first]
    keep = torch.topk(torch.from_numpy(summed).abs(), min(k, uniq.size), sorted=False).indices
    mask = np.zeros(uniq.size, dtype=bool)
    mask[keep.numpy()] = True  # the kept positions in index order: the output stays sorted
    return torch.from_numpy(summed[mask]), torch.from_numpy(uniq[mask])


def _sort_pairs(values: Tensor, indices: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """(values, indices) in increasing index order, and the permutation used (None: they
    were sorted): later merges of sorted pairs need no sort."""
    if indices.numel() < 2:
        return values, indices, None
    # on the CPU's fast path a sort is skipped when the pairs are sorted (merged pairs always
    # are); elsewhere that test would be a host read: sorting sorted pairs costs less
    if cpu_fast(indices) and bool((indices[1:] > indices[:-1]).all()):
        return values, indices, None
    indices, order = torch.sort(indices)
    return values[order], indices, order


def gtopk_allreduce(comm: Communicator, values: Tensor, indices: Tensor, numel: int
                    ) -> Handle[tuple[Tensor, Tensor]]:
    """Start gTopKAllReduce of ``k`` pairs per rank; the handle gives the global ``k`` pairs.

    Args:
        comm: the communicator (one job on its issuing thread: all rounds run in order).
        values: (k,) this rank's values (any float dtype, the same on every rank).
        indices: (k,) their distinct positions in ``[0, numel)``; ``k`` equal on all ranks.
        numel: length of the dense vector (checked against the indices).

    Returns:
        Handle of (values (k,), indices (k,) int64): the sum over ranks restricted to the
        winning indices, identical on every rank. Not averaged: divide by ``comm.size``.
    """
    return gtopk_allreduce_tracked(comm, values, indices, numel).then(lambda r: (r[0], r[1]))


def gtopk_allreduce_tracked(comm: Communicator, values: Tensor, indices: Tensor, numel: int,
                            checks: FlagSink | None = None, step: StepFaults | None = None
                            ) -> Handle[tuple[Tensor, Tensor, Tensor]]:
    """:func:`gtopk_allreduce`, also saying which of this rank's pairs the result includes.

    A pair of this rank is *included* when its value is part of the result's sum: it
    survived every merge on its way to the root. An index can win globally without this
    rank's value (dropped in an early merge, the index won through other ranks); error
    feedback must keep that value (the paper clears every locally selected index that won,
    which loses it). The invariant, exact: summing each rank's included values at their
    indices gives the result. Same bytes as :func:`gtopk_allreduce`: on the tree, each
    child's flag travels in the sign bit of its copy of the int32 indices.

    ``checks``: where the range check of ``indices`` goes, as a device flag read with the
    step's other checks (no host read here); None: checked now, a host read, raising
    ValueError. ``step``: the training step's :class:`~hexagram.comm.gtopk_tree.StepFaults`,
    which agrees on the faults of the messages received once for all its exchanges (None:
    this exchange agrees on its own, and its flag goes to ``checks``).

    Returns:
        Handle of (values (k,), indices (k,) int64, included (k,) bool over ``indices``).

    Example:
        >>> gv, gi, mine = gtopk_allreduce_tracked(comm, v, i, 1000).wait()  # doctest: +SKIP
        >>> residual[i[~mine]]  # still to send                              # doctest: +SKIP
    """
    k = values.numel()
    _check(values, indices, numel, checks if comm.size > 1 else _unused)
    return start_tracked(comm, values, indices,
                         lambda va, ia, vb, ib: merge_topk(va, ia, vb, ib, k),
                         bounds=lambda device: (0, numel),
                         fallback=lambda device: torch.arange(k, device=device),
                         faults=checks, what=f"a tensor of {numel} elements", step=step)


def start_tracked(comm: Communicator, values: Tensor, indices: Tensor, merge: Merger, *,
                  bounds: Bounds, fallback: Callable[[torch.device], Tensor],
                  faults: FlagSink | None, what: str, step: StepFaults | None = None
                  ) -> Handle[tuple[Tensor, Tensor, Tensor]]:
    """The exchange of :func:`gtopk_allreduce_tracked` (inputs checked), every merge by
    ``merge``: the ``k`` pairs of one tensor, or of several tensors at once (bucket
    positions, :mod:`hexagram.comm.gtopk_segments`), travel as one message per edge.

    Each message received is checked (:class:`~hexagram.comm.gtopk_tree.Receipts`:
    ``bounds`` of each pair's index, ``fallback`` indices for a malformed message); the
    ranks agree on the fault, whose flag goes to ``faults`` (None: read here, raising
    :class:`~hexagram.errors.MalformedPayloadError` on every rank), or, with ``step``,
    agree on it with the step's other exchanges (:class:`StepFaults`: one allreduce)."""
    k = values.numel()
    values, indices = values.detach().clone(), indices.detach().long().clone()
    if comm.size == 1:
        return Handle.completed((values, indices, torch.ones(k, dtype=torch.bool,
                                                             device=values.device)), "gtopk")
    up, down = gtopk_bytes(comm.rank, comm.size, k, values.element_size())
    slot = None if step is None else step.open(what)

    def job() -> tuple[Tensor, Tensor, Tensor, Receipts]:
        receipts = Receipts(comm, bounds, fallback(values.device))
        v, i, order = _sort_pairs(values, indices)  # every merge then takes sorted runs
        if butterfly(comm.size):
            gv, gi, mine = _recursive_doubling(comm, v, i, merge, receipts)
        else:
            v, i, merges = _reduce_up_tracked(comm, v, i, merge, receipts)
            comm.counter.add("gtopk.broadcast", down)
            gv, gi, mask = _broadcast_down_tracked(comm, v, i, k, merges, receipts)
            counted = torch.where(mask, gi, torch.full_like(gi, -1))  # -1: not mine
            mine = _included(indices if order is None else indices[order], merges, counted)
        if order is not None:  # ``included`` is over the caller's order of its pairs
            mine = torch.empty_like(mine).scatter_(0, order, mine)
        if step is None or slot is None:
            receipts.agree()  # a fault any rank found, on every rank
        else:  # agreed on with the step's other exchanges, after the last one
            step.record(slot, receipts)
        return gv, gi, mine, receipts

    def report(result: tuple[Tensor, Tensor, Tensor, Receipts]
               ) -> tuple[Tensor, Tensor, Tensor]:
        gv, gi, mine, receipts = result
        if step is not None:
            step.settle()
        elif faults is not None:
            faults(receipts.fault > 0, lambda: receipts.explain(what))
        elif bool(receipts.fault > 0):  # host read: a caller without a step to join
            raise MalformedPayloadError(receipts.explain(what))
        return gv, gi, mine

    return comm.submit("gtopk.reduce", job, up).then(report)


def out_of_range(indices: Tensor, numel: int) -> Tensor:
    """0-d bool on ``indices``' device: some index lies outside ``[0, numel)`` (one pass,
    no host read; False for no indices)."""
    if indices.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=indices.device)
    lo, hi = torch.aminmax(indices)
    return (lo < 0) | (hi >= numel)


def _unused(bad: Tensor, explain: Callable[[], str]) -> None:
    """A :data:`FlagSink` that drops the flag: alone, a rank's indices reach no peer."""


def _check(values: Tensor, indices: Tensor, numel: int, checks: FlagSink | None) -> None:
    if indices.numel() != values.numel() or values.dim() != 1:
        raise ValueError(f"values and indices must be 1-D of equal length, got "
                         f"{tuple(values.shape)} and {tuple(indices.shape)}")
    if numel >= 2**31:
        raise ValueError(f"gtopk_allreduce sends int32 indices; numel={numel} is too large: "
                         "split the tensor (granularity='layer')")

    def explain() -> str:
        return (f"gtopk: indices must lie in [0, {numel}), got [{int(indices.min())}, "
                f"{int(indices.max())}]")

    if checks is _unused:
        return
    bad = out_of_range(indices, numel)
    if checks is not None:  # read with the step's other checks: an index out of range
        checks(bad, explain)  # would corrupt a peer's merge, not fail here
    elif bool(bad):  # host read: a caller without a step to join
        raise ValueError(explain())


def _reduce_up(comm: Communicator, values: Tensor, indices: Tensor, k: int
               ) -> tuple[Tensor, Tensor]:
    """Tree reduction; on return rank 0 holds the global top-k (others: their last state)."""
    v, i, _ = _reduce_up_tracked(comm, values, indices,
                                 lambda va, ia, vb, ib: merge_topk(va, ia, vb, ib, k))
    return v, i


def _broadcast_down(comm: Communicator, values: Tensor, indices: Tensor, k: int
                    ) -> tuple[Tensor, Tensor]:
    """Binomial-tree broadcast from rank 0: receive from my parent, send to my children."""
    v, i, _ = _broadcast_down_tracked(comm, values, indices, k, [])
    return v, i


