"""Coalesced compressed collectives: many tensors, each compressed on its own, one message.

Layer-wise compression (a scale, norm or top-k per tensor; Dutta et al.) with one
collective per tensor pays a collective's latency and issuing cost per tensor: a transformer
block has a dozen tensors, most of them tiny. These variants compress every tensor
separately, with exactly the payload formats and byte counts of the one-tensor primitives in
:mod:`hexagram.comm.primitives`, but send all the payloads of a call in one all-to-all and
one allgather (scatter-gather) or one allgather (gather-only formats).

Example:
    >>> h = allgather_payloads_many(comm, [c.compress(a), c.compress(b)])  # doctest: +SKIP
    >>> per_tensor = h.wait()      # per_tensor[i][r]: rank r's payload of tensor i
    ... # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from hexagram.comm.communicator import Communicator, Deferred, Handle
from hexagram.comm.primitives import _chunks, _decode_rows
from hexagram.compress.base import Compressor, Payload

__all__ = ["allgather_payloads_many", "scatter_gather_many"]


def allgather_payloads_many(comm: Communicator, payloads: Sequence[Payload]
                            ) -> Handle[list[list[Payload]]]:
    """Every rank's payloads in one allgather: ``result[i][r]`` is rank ``r``'s payload
    ``i`` (payload ``i`` has the same layout on every rank)."""
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

    return comm.submit("allgather_payloads", job, comm.allgather_bytes(send.numel()))


def scatter_gather_many(comm: Communicator, tensors: Sequence[Tensor], compressor: Compressor,
                        average: bool = True, generator: torch.Generator | None = None,
                        reduce_generator: torch.Generator | None = None,
                        outs: Sequence[Tensor] | None = None) -> Handle[list[Tensor]]:
    """:func:`hexagram.comm.primitives.scatter_gather` of several tensors in one all-to-all
    and one allgather (each tensor compressed in P chunks of its own).

    Returns the reduced tensors (the mean with ``average``), written into ``outs`` when given
    (each may be the input itself: inputs are fully compressed before this returns). The
    first compressions use ``generator`` on the caller's thread, the second ones
    ``reduce_generator`` (default ``generator``) on the issuing thread, tensor by tensor.
    """
    results = list(outs) if outs is not None else [torch.empty_like(t) for t in tensors]
    if comm.size == 1:
        for t, out in zip(tensors, results):
            out.copy_(compressor.decompress(compressor.compress(t, generator)).view_as(out))
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
        dist.all_to_all_single(recv, send, group=comm.group, async_op=True).wait(comm.timeout)
        blocks = [b.split(sizes) for b in recv.view(size, -1)]
        mine = [_reduce_chunk(compressor, [first[i][0].from_buffer(blocks[s][i])
                                           for s in range(size)], rows[i][0], average)
                for i in range(len(rows))]
        reduced = [compressor.compress(m, second) for m in mine]
        buf = torch.cat([p.to_buffer() for p in reduced])
        comm.counter.add("scatter_gather.allgather", comm.allgather_bytes(buf.numel()))
        gathered = [torch.empty_like(buf) for _ in range(size)]
        dist.all_gather(gathered, buf, group=comm.group, async_op=True).wait(comm.timeout)
        parts = [g.split([p.nbytes for p in reduced]) for g in gathered]
        for i, (p, out) in enumerate(zip(reduced, results)):
            _decode_rows(compressor, [p.from_buffer(parts[r][i]) for r in range(size)],
                         out.view(-1), mine[i])
        return results

    return comm.submit("scatter_gather.alltoall", job, comm.alltoall_bytes(send.numel()))


def _reduce_chunk(compressor: Compressor, copies: list[Payload], like: Tensor,
                  average: bool) -> Tensor:
    """The P received copies of my chunk (shaped like ``like``), decoded and summed in rank
    order (/ P)."""
    mine = torch.empty_like(like)
    for i, p in enumerate(copies):
        compressor.decompress_into(p, mine, add=i > 0)
    return mine.div_(len(copies)) if average else mine
