"""gTopKAllReduce's exchange: the binomial tree, recursive doubling, and the checks of
what a rank receives (:mod:`hexagram.comm.gtopk` has the algorithm and its entry points).

Received pairs are not trusted. A message a rank receives is decoded by that rank alone,
merged and forwarded, so :class:`Receipts` checks each one on the device (indices inside
their tensor's range and strictly increasing, as every honest message is; values finite),
replaces a malformed one by harmless pairs (zero values at valid, distinct positions: the
merge keeps its fixed sizes, so no peer waits on a message of another size), and keeps
the first culprit. A malformed message reaches only the ranks downstream of it (the
culprit itself never learns), so the ranks must agree on it: alone, an exchange ends with
one 8-byte allreduce (max) of the culprit's code (:meth:`Receipts.agree`); within a
training step, :class:`StepFaults` collects the faults of all the step's exchanges and
agrees on them with ONE 8-byte allreduce (min) after the last one, so a step of many
buckets pays one latency, not one per bucket. Either way every rank then holds the same
fault, raised at the same step naming the same sender. Nothing here reads the device.

Example:
    >>> tree_parent(6, 8), tree_children(0, 8)
    (4, [4, 2, 1])
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.device import needs_host_staging
from hexagram.comm.primitives import _exchange_works as exchange_works
from hexagram.compress.faults import any_of, beyond
from hexagram.compress.packing import cpu_fast

__all__ = ["Bounds", "Merge", "Merger", "Receipts", "StepFaults", "tree_children",
           "tree_parent"]

#: one merge a rank performed: (the peer's pairs' indices it merged in, the kept indices)
Merge = tuple[Tensor, Tensor]
#: merges two sets of pairs, each sorted by index, into the kept set (sorted by index):
#: (values_a, indices_a, values_b, indices_b) -> (values, indices)
Merger = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
#: ``bounds(device) -> (lo, hi)``: per pair of a message (in index order), the range its
#: index must lie in (0-d for one tensor, (k,) for a bucket's tensors)
Bounds = Callable[[torch.device], tuple[Tensor | int, Tensor | int]]


@dataclass
class Receipts:
    """The checks of the messages one rank receives in one exchange (module doc).

    ``fault``: 0 while every message was well formed, else ``sender * size + rank + 1``
    of the first malformed one (a 0-d int64 on the pairs' device), after :meth:`agree`
    the largest over the ranks. ``fallback``: (k,) valid distinct indices (sorted), what
    a malformed message's indices become.
    """

    comm: Communicator
    bounds: Bounds
    fallback: Tensor
    fault: Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.fault = torch.zeros((), dtype=torch.int64, device=self.fallback.device)

    def take(self, values: Tensor, indices: Tensor, sender: int
             ) -> tuple[Tensor, Tensor, Tensor]:
        """``(values, indices, bad)``: the message of ``sender`` as received when well
        formed (bit for bit), else zeros at :attr:`fallback`; ``bad`` its 0-d flag."""
        lo, hi = self.bounds(indices.device)
        flags = [((indices < lo) | (indices >= hi)).any(), beyond(values, values.dtype)]
        if indices.numel() > 1:
            flags.append((indices[1:] <= indices[:-1]).any())
        bad = any_of(flags)
        if self.fault.device != bad.device:
            bad = bad.to(self.fault.device)
        code = sender * self.comm.size + self.comm.rank + 1
        self.fault = torch.where((self.fault == 0) & bad, code, self.fault)
        return (torch.where(bad, torch.zeros_like(values), values),
                torch.where(bad, self.fallback, indices), bad)

    def agree(self) -> Tensor:
        """Every rank's :attr:`fault`, the largest (one 8-byte allreduce on the issuing
        thread, counted as ``gtopk.fault``); returns it (and keeps it)."""
        self.fault = _agree_code(self.comm, self.fault, lowest=False)
        return self.fault

    def explain(self, what: str) -> str:
        """The message of a fault (reads :attr:`fault`: only on a failure)."""
        return _explain(self.comm.size, int(self.fault) - 1, what)


#: :class:`StepFaults`' code of "no fault" (the identity of the min over ranks)
NO_FAULT = torch.iinfo(torch.int64).max


class StepFaults:
    """The received-message faults of one training step's exchanges, agreed on by ONE
    8-byte allreduce (min) after the step's last exchange, instead of one per exchange.

    Protocol (every rank calls the same methods in the same order: the exchanges are
    collectives): :meth:`open` when an exchange is submitted (it gets a slot, and its
    ``what`` for the message); :meth:`record` from the exchange's job on the issuing
    thread, once its :class:`Receipts` are complete; :meth:`settle` when its result is
    taken; :meth:`close` at the end of the step, which submits the agreement (it runs on
    the issuing thread after every exchange of the step). Once closed and every exchange
    settled, the agreed flag goes to ``sink`` (e.g. ``ctx.checks.add``: read with the
    step's other checks, no host read here): at :meth:`close` when the step's results
    were all taken (the engine waits them before the end of backward), else when the last
    one is (a one-step delay takes them in the next step, as it takes the results).

    A fault of slot ``s`` is coded ``s P^2 + sender P + reporter + 1`` (P ranks); the
    minimum over ranks names the first faulty exchange of the step, and every rank holds
    the same code: the same error, naming the same sender, at the same step.

    Example:
        >>> faults = StepFaults(comm, ctx.checks.add)  # doctest: +SKIP
        >>> gtopk_allreduce_tracked(comm, v, i, n, faults=faults).wait()  # doctest: +SKIP
        >>> faults.close()  # one allreduce for every exchange since  # doctest: +SKIP
    """

    def __init__(self, comm: Communicator, sink: Callable[[Tensor, Callable[[], str]], None]
                 ) -> None:
        self.comm, self.sink = comm, sink
        self.whats: list[str] = []  # per slot, what its exchange carried
        self.code: Tensor | None = None  # 0-d int64: the lowest code recorded so far
        self._agreed: Handle[Tensor] | None = None
        self._unsettled, self._reported = 0, False
        self._lock = threading.Lock()

    def open(self, what: str) -> int:
        """A new exchange's slot (on the submitting thread, in submission order)."""
        with self._lock:
            self.whats.append(what)
            self._unsettled += 1
            return len(self.whats) - 1

    def record(self, slot: int, receipts: Receipts) -> None:
        """Fold ``receipts``' fault into the step's (on the issuing thread; no host read)."""
        size = self.comm.size
        code = torch.where(receipts.fault > 0, receipts.fault + slot * size * size, NO_FAULT)
        self.code = code if self.code is None else torch.minimum(self.code, code)

    def settle(self) -> None:
        """An exchange's result was taken."""
        with self._lock:
            self._unsettled -= 1
        self._report()

    def close(self) -> None:
        """Submit the step's one agreement (after every exchange :meth:`open` announced)."""
        self._agreed = self.comm.submit("gtopk.fault", self._agree)
        self._report()

    def _agree(self) -> Tensor:
        code = self.code if self.code is not None else torch.full(
            (), NO_FAULT, dtype=torch.int64, device=self.comm.device)  # no exchange ended
        return _agree_code(self.comm, code, lowest=True)

    def _report(self) -> None:
        """The agreed flag to ``sink``, once closed and settled (once)."""
        with self._lock:
            if self._agreed is None or self._unsettled > 0 or self._reported:
                return
            self._reported = True
        code = self._agreed.wait()
        self.sink(code < NO_FAULT, lambda: self.explain(code))

    def explain(self, code: Tensor) -> str:
        """The message of an agreed fault ``code`` (reads it: only on a failure)."""
        slot, rest = divmod(int(code) - 1, self.comm.size ** 2)
        return _explain(self.comm.size, rest, self.whats[slot])


def _agree_code(comm: Communicator, code: Tensor, lowest: bool) -> Tensor:
    """``code`` (0-d int64), the lowest (else the largest) over ``comm``: one 8-byte
    allreduce on the calling (issuing) thread, counted as ``gtopk.fault``; a CUDA tensor
    on gloo goes through host memory."""
    fault = code.reshape(1).clone()
    staged = fault.device.type == "cuda" and needs_host_staging(fault, comm)
    wire = fault.cpu() if staged else fault
    op = dist.ReduceOp.MIN if lowest else dist.ReduceOp.MAX
    work = dist.all_reduce(wire, op=op, group=comm.group, async_op=True)
    assert work is not None
    comm.counter.add("gtopk.fault", comm.ring_allreduce_bytes(wire))
    comm.await_work(work)
    return (wire.to(fault.device) if staged else wire).reshape(())


def _explain(size: int, code: int, what: str) -> str:
    """The message of the fault ``code`` = ``sender * size + reporter`` for ``what``."""
    culprit, reporter = divmod(code, size)
    from hexagram.comm.faults import _FIX, MALFORMED

    return (f"{MALFORMED}: gtopk: rank {culprit} sent malformed (value, index) pairs "
            f"for {what} (indices outside their tensor, repeated or out of order, or "
            f"values NaN/Inf; reported by rank {reporter}, which received them); {_FIX}")


def tree_parent(rank: int, size: int) -> int | None:
    """Parent of ``rank`` in the binomial tree rooted at 0 (``None`` for the root).

    The parent clears the lowest set bit: 6 -> 4, 5 -> 4, 4 -> 0.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in [0, {size})")
    return None if rank == 0 else rank & (rank - 1)


def tree_children(rank: int, size: int) -> list[int]:
    """Children of ``rank``, in the order the broadcast sends to them (farthest first)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in [0, {size})")
    out, d = [], 1
    while d < size and rank % (2 * d) == 0:
        if rank + d < size:
            out.append(rank + d)
        d *= 2
    return list(reversed(out))


def _isin(elements: Tensor, test: Tensor) -> Tensor:
    """``torch.isin(elements, test)`` for unique ``test``; on CPU by binary search in the
    sorted ``test`` (``torch.isin`` sorts both, several times slower at k = 25K). ``test``
    may repeat -1, which no index equals (a placeholder for "not counted")."""
    if not cpu_fast(elements) or test.numel() == 0:
        return torch.isin(elements, test)
    t = test.numpy()
    if t.size > 1 and not bool((t[1:] > t[:-1]).all()):
        t = np.sort(t)
    e = elements.numpy()
    pos = np.minimum(np.searchsorted(t, e), t.size - 1)
    return torch.from_numpy(t[pos] == e)


def _send(comm: Communicator, buf: Tensor, peer: int) -> None:
    if needs_host_staging(buf, comm):  # gloo sends host memory only
        buf = buf.cpu()
    work = dist.isend(buf, comm.global_rank(peer), group=comm.group)
    assert work is not None  # None only for ranks outside the group
    comm.await_work(work)


def _recv(comm: Communicator, buf: Tensor, peer: int) -> None:
    target, host = buf, needs_host_staging(buf, comm)
    if host:  # gloo receives into host memory only
        buf = torch.empty_like(buf, device="cpu")
    work = dist.irecv(buf, comm.global_rank(peer), group=comm.group)
    assert work is not None
    comm.await_work(work)
    if host:
        target.copy_(buf)


def _pack(values: Tensor, indices: Tensor) -> Tensor:
    return torch.cat([values.contiguous().view(torch.uint8),
                      indices.to(torch.int32).contiguous().view(torch.uint8)])


def _unpack(buf: Tensor, k: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    split = k * torch.empty(0, dtype=dtype).element_size()
    return buf[:split].view(dtype).clone(), buf[split:].view(torch.int32).long()





def _survived(indices: Tensor, merges: list[Merge]) -> Tensor:
    """Which of ``indices`` are kept by every one of ``merges`` (bool, per index)."""
    alive = torch.ones(indices.numel(), dtype=torch.bool, device=indices.device)
    for _, kept in merges:
        alive &= _isin(indices, kept)
    return alive


def _included(own: Tensor, merges: list[Merge], counted: Tensor) -> Tensor:
    """Own pairs that survived all my merges and whose index my set contributed to the
    result (``counted``: the result's indices that include my outgoing set's value)."""
    return _survived(own, merges) & _isin(own, counted)


def _reduce_up_tracked(comm: Communicator, values: Tensor, indices: Tensor, merge: Merger,
                       receipts: Receipts | None = None
                       ) -> tuple[Tensor, Tensor, list[Merge]]:
    """Tree reduction (rank 0 ends with the global top-k, the others with their last
    state), also returning the merges this rank performed, in order. ``receipts`` checks
    each message received (None: taken as it came)."""
    rank, size, d, k = comm.rank, comm.size, 1, values.numel()
    merges: list[Merge] = []
    while d < size:
        if rank % (2 * d) == d:  # my turn to hand my k pairs to my parent, then I'm done
            _send(comm, _pack(values, indices), rank - d)
            break
        if rank + d < size:  # rank % 2d == 0 here: receive from the child of this round
            buf = torch.empty(k * (values.element_size() + 4), dtype=torch.uint8,
                              device=values.device)
            _recv(comm, buf, rank + d)
            other_v, other_i = _unpack(buf, k, values.dtype)
            if receipts is not None:
                other_v, other_i, _ = receipts.take(other_v, other_i, rank + d)
            values, indices = merge(values, indices, other_v, other_i)
            merges.append((other_i, indices))
        d *= 2
    return values, indices, merges


def _recursive_doubling(comm: Communicator, values: Tensor, indices: Tensor, merge: Merger,
                        receipts: Receipts | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Round d = 1, 2, 4, ...: exchange k pairs with ``rank ^ d`` (both directions at once)
    and keep the merge; every rank ends with the global top-k (see the module docstring)
    and knows which of its own pairs survived every merge (those the result includes)."""
    k = values.numel()
    own, alive, d = indices, torch.ones(k, dtype=torch.bool, device=indices.device), 1
    while d < comm.size:
        peer = comm.rank ^ d
        send = _pack(values, indices)
        recv = torch.empty_like(send)
        # both directions at once; CUDA tensors on gloo go through host memory
        comm.await_work(exchange_works(comm, send, [recv], [peer], [peer]))
        other_v, other_i = _unpack(recv, k, values.dtype)
        if receipts is not None:
            other_v, other_i, _ = receipts.take(other_v, other_i, peer)
        values, indices = merge(values, indices, other_v, other_i)
        alive &= _isin(own, indices)
        d *= 2
    return values, indices, alive


def _broadcast_down_tracked(comm: Communicator, values: Tensor, indices: Tensor, k: int,
                            merges: list[Merge], receipts: Receipts | None = None
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """Binomial-tree broadcast from rank 0 (receive from my parent, send to my children),
    also returning ``mask`` over the result: where it includes
    the value this rank sent up (the root: everywhere). Each child's copy flags, in the
    index's sign bit (``~index``), where it includes that child's value; ``merges`` are
    this rank's from :func:`_reduce_up_tracked` (empty: children are flagged nowhere)."""
    parent = tree_parent(comm.rank, comm.size)
    if parent is None:
        mask = torch.ones(k, dtype=torch.bool, device=values.device)
    else:
        buf = torch.empty(k * (values.element_size() + 4), dtype=torch.uint8,
                          device=values.device)
        _recv(comm, buf, parent)
        values, signed = _unpack(buf, k, values.dtype)
        mask = signed < 0
        indices = torch.where(mask, ~signed, signed)
        if receipts is not None:  # a malformed copy: harmless pairs, none of them mine
            values, indices, bad = receipts.take(values, indices, parent)
            mask = mask & ~bad
    children = tree_children(comm.rank, comm.size)
    # merges[t] merged the child of round t: children come farthest (last merged) first
    by_child = dict(zip(reversed(children), range(len(merges))))
    for child in children:
        flag = torch.zeros_like(mask)
        if child in by_child:
            t = by_child[child]
            theirs = merges[t][0]
            survived = _survived(theirs, merges[t:])
            counted = torch.where(survived, theirs, torch.full_like(theirs, -1))  # -1: none
            flag = mask & _isin(indices, counted)
        _send(comm, _pack(values, torch.where(flag, ~indices, indices)), child)
    return values, indices, mask
