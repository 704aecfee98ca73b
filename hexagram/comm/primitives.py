"""Collective primitives: centralized / decentralized x full / low precision.

BAGUA's four synchronous primitives, over a :class:`Communicator`, all asynchronous (each
returns a :class:`Handle`) and all counting the bytes this rank sends:

- C_FP_S :func:`allreduce` (full precision, centralized)
- C_LP_S :func:`allreduce_payloads` for compressors whose payloads can be summed,
  :func:`scatter_gather` (compress -> all-to-all -> decompress, reduce -> compress ->
  allgather) for those that cannot, :func:`allgather_payloads` for gather-only formats
- D_FP_S :func:`neighbor_exchange` (send my tensor to peers, receive theirs)
- D_LP_S :func:`neighbor_exchange_payloads` (the same with compressed payloads)

:func:`scatter_gather_many` and :func:`allgather_payloads_many` take several tensors, each
compressed on its own (layer-wise), and send them in one message per leg.

Nothing here knows about algorithms; low-precision variants take a compressor object.
Algorithms do not pick among these themselves: :func:`hexagram.comm.reduce.reduce` does,
from the compressor's aggregation, with one rule.

Example:
    >>> h = allreduce(comm, torch.ones(4), average=True)   # doctest: +SKIP
    >>> h.wait()                                           # doctest: +SKIP
    tensor([1., 1., 1., 1.])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hexagram.comm.communicator import Communicator, Deferred, Handle
from hexagram.comm.device import needs_host_staging
from hexagram.comm.faults import FaultSink, check_gathered, payload_flags, poison
from hexagram.compress.base import Compressor, Payload
from hexagram.compress.combine import decode_sum

__all__ = [
    "allgather_payloads",
    "allgather_payloads_many",
    "allreduce",
    "allreduce_payloads",
    "broadcast",
    "neighbor_exchange",
    "neighbor_exchange_payloads",
    "scatter_gather",
    "scatter_gather_many",
]


class _AllWorks:
    """Several torch Works waited as one."""

    def __init__(self, works: Sequence[Any], after: Callable[[], None] | None = None) -> None:
        self.works = list(works)
        self._after = after  # runs once every work is done (copy host staging back)

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self.works:
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout)
        after, self._after = self._after, None
        if after is not None:
            after()
        return True


def allreduce(comm: Communicator, tensor: Tensor, average: bool = True) -> Handle[Tensor]:
    """Allreduce ``tensor`` in place (sum, or mean with ``average``); result is ``tensor``.

    Averaging divides *before* the sum, as PyTorch DDP does, so results match it bit for bit.
    """
    if comm.size == 1:
        return Handle.completed(tensor, "allreduce")

    def job() -> Deferred:
        if average:
            tensor.div_(comm.size)
        work = dist.all_reduce(tensor, group=comm.group, async_op=True)
        return Deferred(work, lambda: tensor)

    return comm.submit("allreduce", job, comm.ring_allreduce_bytes(tensor), inline=True)


def broadcast(comm: Communicator, tensors: Sequence[Tensor], src: int = 0) -> Handle[None]:
    """Broadcast ``tensors`` in place from group rank ``src``, coalesced per dtype."""
    if comm.size == 1 or not tensors:
        return Handle.completed(None, "broadcast")
    by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def job() -> None:
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            dist.broadcast(flat, src=comm.global_rank(src), group=comm.group)
            offset = 0
            with torch.no_grad():
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    return comm.submit("broadcast", job, nbytes * (comm.size - 1) if comm.rank == src else 0)


def allgather_payloads(comm: Communicator, payload: Payload) -> Handle[list[Payload]]:
    """Every rank's payload (same layout everywhere), for formats that cannot be summed."""
    return allgather_payloads_many(comm, [payload]).then(lambda per_tensor: per_tensor[0])


def allgather_payloads_many(comm: Communicator, payloads: Sequence[Payload]
                            ) -> Handle[list[list[Payload]]]:
    """Several payloads of every rank in one allgather: ``result[i][r]`` is rank ``r``'s
    payload ``i`` (payload ``i`` has the same layout on every rank). Same bytes as one
    :func:`allgather_payloads` per payload, one message instead of many."""
    if comm.size == 1:
        return Handle.completed([[p] for p in payloads], "allgather_payloads")
    bufs = [p.to_buffer() for p in payloads]
    sizes = [b.numel() for b in bufs]
    send = torch.cat(bufs)
    out = [torch.empty_like(send) for _ in range(comm.size)]

    def finish() -> list[list[Payload]]:
        parts = [o.split(sizes) for o in out]
        return [[p.from_buffer(parts[r][i]) for r in range(comm.size)]
                for i, p in enumerate(payloads)]

    def job() -> Deferred:
        return Deferred(dist.all_gather(out, send, group=comm.group, async_op=True), finish)

    return comm.submit("allgather_payloads", job, comm.allgather_bytes(send.numel()),
                       inline=True)


def allreduce_payloads(comm: Communicator, payloads: Sequence[Payload]
                       ) -> Handle[list[Payload]]:
    """Sum every payload's tensors over the ranks, in place, in compressed form (formats
    whose payloads sum tensor by tensor: ``Aggregation.SUM`` with
    ``payload_sums_elementwise``); the result is ``payloads``, now holding the sums.
    :func:`hexagram.comm.reduce.reduce` encodes (divided by P for a mean) and decodes."""
    if comm.size == 1:
        return Handle.completed(list(payloads), "allreduce_compressed")
    wire = [t for p in payloads for t in p.tensors]
    nbytes = sum(comm.ring_allreduce_bytes(t) for t in wire)

    def job() -> Deferred:
        works = [dist.all_reduce(t, group=comm.group, async_op=True) for t in wire]
        return Deferred(_AllWorks(works), lambda: list(payloads))

    return comm.submit("allreduce_compressed", job, nbytes, inline=True)


def _chunks(tensor: Tensor, parts: int) -> tuple[Tensor, int]:
    """``tensor`` flattened and zero-padded to ``parts`` equal rows: (parts x m, numel)."""
    flat = tensor.reshape(-1)
    n = flat.numel()
    m = -(-n // parts)
    if m * parts != n:
        flat = torch.cat([flat, flat.new_zeros(m * parts - n)])
    return flat.view(parts, m), n


def scatter_gather(comm: Communicator, tensor: Tensor, compressor: Compressor,
                   average: bool = True, generator: torch.Generator | None = None,
                   reduce_generator: torch.Generator | None = None,
                   out: Tensor | None = None) -> Handle[Tensor]:
    """Reduce ``tensor`` with compression on both legs (BAGUA's ByteGrad pattern).

    Each rank compresses P chunks, all-to-all sends chunk j to rank j, rank j decompresses
    and sums its P copies, recompresses the reduced chunk and allgathers it; everyone then
    decompresses all P reduced chunks. Returns a new tensor shaped like ``tensor``, or
    ``out`` (same shape and dtype; may be ``tensor`` itself: the input is fully compressed
    before this returns) with the result written into it.

    The first compression runs on the caller's thread with ``generator``, the second on the
    issuing thread with ``reduce_generator`` (default: ``generator``). Give stochastic
    compressors two generators when calls overlap: one generator drawn from by both threads
    makes the draws' order, hence the results, depend on thread timing.
    """
    return scatter_gather_many(comm, [tensor], compressor, average, generator,
                               reduce_generator, None if out is None else [out]
                               ).then(lambda results: results[0])


def scatter_gather_many(comm: Communicator, tensors: Sequence[Tensor], compressor: Compressor,
                        average: bool = True, generator: torch.Generator | None = None,
                        reduce_generator: torch.Generator | None = None,
                        outs: Sequence[Tensor] | None = None,
                        faults: FaultSink | None = None) -> Handle[list[Tensor]]:
    """:func:`scatter_gather` of several tensors in one all-to-all and one allgather.

    Each tensor is compressed in P chunks of its own (layer-wise scales and norms) with
    exactly the payloads and bytes of one :func:`scatter_gather` per tensor, and the draws
    happen in the same order, so the results are identical; only the number of messages
    differs (a collective's latency per tensor adds up on models with many small tensors).

    ``faults`` (see :mod:`hexagram.comm.faults`): the owner of a chunk checks the copies it
    received and, where one is malformed, sends its re-encoded chunk poisoned naming the
    sender; every rank checks the allgathered chunks, so every rank flags it.
    """
    results = list(outs) if outs is not None else [torch.empty_like(t) for t in tensors]
    if comm.size == 1:
        for t, res in zip(tensors, results):
            res.copy_(compressor.decompress(compressor.compress(t, generator)).view_as(res))
        return Handle.completed(results, "scatter_gather")
    size = comm.size
    rows = [_chunks(t.detach(), size)[0] for t in tensors]
    first = [[compressor.compress(r[j], generator) for j in range(size)] for r in rows]
    sizes = [p[0].nbytes for p in first]  # the chunks of one tensor share a layout
    # destination-major: block j holds chunk j of every tensor, for rank j
    send = torch.cat([first[i][j].to_buffer() for j in range(size) for i in range(len(rows))])
    second = generator if reduce_generator is None else reduce_generator

    def job() -> list[Tensor]:
        recv = torch.empty_like(send)
        comm.await_work(dist.all_to_all_single(recv, send, group=comm.group, async_op=True))
        blocks = [b.split(sizes) for b in recv.view(size, -1)]
        copies = [[first[i][0].from_buffer(blocks[s][i]) for s in range(size)]
                  for i in range(len(rows))]
        flags = [None if faults is None else payload_flags(compressor, c) for c in copies]
        mine = [_sum_copies(compressor, c, rows[i][0], average) for i, c in enumerate(copies)]
        reduced = [compressor.compress(m, second) for m in mine]
        reduced = [p if f is None else poison(p, f) for p, f in zip(reduced, flags)]
        buf = torch.cat([p.to_buffer() for p in reduced])
        comm.counter.add("scatter_gather.allgather", comm.allgather_bytes(buf.numel()))
        gathered = [torch.empty_like(buf) for _ in range(size)]
        comm.await_work(dist.all_gather(gathered, buf, group=comm.group, async_op=True))
        parts = [g.split([p.nbytes for p in reduced]) for g in gathered]
        for i, (p, res) in enumerate(zip(reduced, results)):
            chunks = [p.from_buffer(parts[r][i]) for r in range(size)]
            check_gathered(faults, compressor, chunks, f"tensor {i} of the message")
            _decode_rows(compressor, chunks, res.view(-1), mine[i])
        # the copies only this rank decoded, queued after the chunks every rank decoded
        # (a malformed copy poisoned its chunk: every rank names the same tensor first)
        for i, (c, f) in enumerate(zip(copies, flags)):
            check_gathered(faults, compressor, c, f"tensor {i} of the message", flags=f)
        return results

    return comm.submit("scatter_gather.alltoall", job, comm.alltoall_bytes(send.numel()))


def _sum_copies(compressor: Compressor, copies: Sequence[Payload], like: Tensor,
                average: bool) -> Tensor:
    """The P received copies of my chunk, decoded into one buffer shaped like ``like``,
    summed in rank order (divided by P with ``average``)."""
    size = len(copies)
    return decode_sum(compressor, copies, torch.empty_like(like),
                      (lambda t: t.div_(size)) if average else None)


def _decode_rows(compressor: Compressor, payloads: list[Payload], flat: Tensor,
                 spare: Tensor) -> None:
    """Decode payload j (a chunk of ``spare.numel()`` elements) into chunk j of ``flat``;
    the last chunk may be cut short by padding: it is decoded into ``spare`` first."""
    m = spare.numel()
    for j, p in enumerate(payloads):
        dst = flat[j * m : (j + 1) * m]
        if dst.numel() == m:
            compressor.decompress_into(p, dst)
        elif dst.numel():
            dst.copy_(compressor.decompress_into(p, spare)[: dst.numel()])


def _exchange_works(comm: Communicator, send: Tensor, recv: list[Tensor],
                    send_to: Sequence[int], recv_from: Sequence[int]) -> _AllWorks:
    staged = needs_host_staging(send, comm)  # gloo's point-to-point needs host memory
    wire_send = send.cpu() if staged else send
    wire_recv = [torch.empty_like(r, device="cpu") for r in recv] if staged else recv
    ops = [dist.P2POp(dist.isend, wire_send, comm.global_rank(p), comm.group)
           for p in send_to]
    ops += [dist.P2POp(dist.irecv, r, comm.global_rank(p), comm.group)
            for p, r in zip(recv_from, wire_recv)]

    def copy_back() -> None:
        for r, h in zip(recv, wire_recv):
            r.copy_(h)

    return _AllWorks(dist.batch_isend_irecv(ops) if ops else [],
                     copy_back if staged else None)


def neighbor_exchange(comm: Communicator, tensor: Tensor, send_to: Sequence[int],
                      recv_from: Sequence[int]) -> Handle[list[Tensor]]:
    """Send ``tensor`` to group ranks ``send_to``; return the tensors of ``recv_from``.

    Every rank must call it with matching peer lists (if i sends to j, j receives from i).
    """
    send = tensor.detach().contiguous().clone()
    recv = [torch.empty_like(send) for _ in recv_from]
    if not send_to and not recv_from:
        return Handle.completed([], "neighbor_exchange")

    def job() -> Deferred:
        return Deferred(_exchange_works(comm, send, recv, send_to, recv_from), lambda: recv)

    nbytes = len(send_to) * send.numel() * send.element_size()
    return comm.submit("neighbor_exchange", job, nbytes)


def neighbor_exchange_payloads(comm: Communicator, payload: Payload, send_to: Sequence[int],
                               recv_from: Sequence[int]) -> Handle[list[Payload]]:
    """:func:`neighbor_exchange` for compressed payloads of one layout."""
    buf = payload.to_buffer()
    recv = [torch.empty_like(buf) for _ in recv_from]
    if not send_to and not recv_from:
        return Handle.completed([], "neighbor_exchange_payloads")

    def job() -> Deferred:
        return Deferred(_exchange_works(comm, buf, recv, send_to, recv_from),
                        lambda: [payload.from_buffer(b) for b in recv])

    return comm.submit("neighbor_exchange_payloads", job, len(send_to) * buf.numel())
