"""Shard-wise map: every rank reduces one shard of all ranks' vectors with a caller's function.

:func:`shard_map` splits a flat tensor into P shards (zero-padded to equal length), sends
shard ``j`` of every rank to rank ``j`` with one all-to-all, calls ``fn(rows, info)`` on the
``(P, m)`` rows of its shard (row ``i`` from group rank ``i``), and allgathers the ``(m,)``
results, so every rank ends with the full reduced vector. Each rank sends about
``2 (P-1)/P`` times the tensor, like a ring allreduce, instead of ``(P-1)`` times with a
plain allgather of whole vectors. ``fn`` may call ``info.allreduce(small)`` (blocking, on the
issuing thread, bytes counted) to combine a few numbers across shards, e.g. partial Gram
matrices.

With a ``compressor`` both legs carry its payloads: each shard is compressed before the
all-to-all and decoded on arrival (``fn`` sees the decoded copies, one per rank, never a
sum), and the reduced shard is compressed again before the allgather.

Nothing here knows what ``fn`` computes.

Example:
    >>> h = shard_map(comm, grad, lambda rows, info: rows.mean(0))  # doctest: +SKIP
    >>> h.wait()   # the mean over ranks, shard by shard                # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hexagram.comm.communicator import Communicator, Handle
from hexagram.compress.base import Compressor, Payload

__all__ = ["ShardInfo", "all_gather_flat", "shard_layout", "shard_map"]

# torch >= 2.13 renamed all_gather_into_tensor (the old name warns); torch 2.4 has only it
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_flat(out: Tensor, tensor: Tensor, group: dist.ProcessGroup | None = None,
                    async_op: bool = False) -> Any:
    """Gather every rank's ``tensor`` into ``out`` (``P * numel``, rank order)."""
    return _ALL_GATHER_FLAT(out, tensor, group=group, async_op=async_op)


def shard_layout(numel: int, parts: int) -> int:
    """Length ``m`` of each of ``parts`` equal shards covering ``numel`` elements."""
    return -(-numel // max(parts, 1))


@dataclass
class ShardInfo:
    """What ``fn`` knows about its shard.

    Attributes:
        index: this rank's shard number (its group rank).
        start: offset of the shard in the flat tensor (the shard may run past the end:
            the tail is zero padding).
        length: ``m``, the padded shard length.
        numel: the flat tensor's true length.
    """

    index: int
    start: int
    length: int
    numel: int
    _comm: Communicator | None = None

    def allreduce(self, t: Tensor) -> Tensor:
        """Sum ``t`` over ranks in place, now (blocking); bytes counted as ``shard_map.sync``.
        Every rank's ``fn`` must make the same calls in the same order."""
        comm = self._comm
        if comm is None or comm.size == 1:
            return t
        comm.counter.add("shard_map.sync", comm.ring_allreduce_bytes(t))
        comm.await_work(dist.all_reduce(t, group=comm.group, async_op=True))
        return t


ShardFn = Callable[[Tensor, ShardInfo], Tensor]


def _pad_rows(flat: Tensor, parts: int) -> Tensor:
    m = shard_layout(flat.numel(), parts)
    if m * parts != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(m * parts - flat.numel())])
    return flat.view(parts, m)


def shard_map(comm: Communicator, tensor: Tensor, fn: ShardFn,
              compressor: Compressor | None = None, generator: torch.Generator | None = None,
              out: Tensor | None = None, reduce_generator: torch.Generator | None = None
              ) -> Handle[Tensor]:
    """Reduce ``tensor`` across ranks shard by shard with ``fn``; see the module docstring.

    Returns ``out`` (or a new tensor shaped like ``tensor``) holding the concatenated
    results of every rank's ``fn``. ``tensor`` is read (and, with a compressor, fully
    compressed) before this returns, so it may be ``out``. A stochastic compressor draws
    from ``generator`` on the caller's thread (first leg) and from ``reduce_generator``
    (default: ``generator``) on the issuing thread (second leg): give two generators when
    calls overlap, or the draws' order depends on thread timing.
    """
    result = torch.empty_like(tensor) if out is None else out
    rows = _pad_rows(tensor.detach().reshape(-1), comm.size)
    info = ShardInfo(comm.rank, comm.rank * rows.shape[1], rows.shape[1], tensor.numel(), comm)
    if comm.size == 1:
        mine = rows.clone() if compressor is None else _roundtrip(compressor, rows, generator)
        result.view(-1).copy_(fn(mine, info)[: tensor.numel()])
        return Handle.completed(result, "shard_map")
    if compressor is None:
        return _plain(comm, rows.contiguous().clone(), fn, info, result)
    second = generator if reduce_generator is None else reduce_generator
    return _compressed(comm, rows, fn, info, result, compressor, (generator, second))


def _roundtrip(compressor: Compressor, rows: Tensor, gen: torch.Generator | None) -> Tensor:
    return compressor.decompress(compressor.compress(rows[0], gen)).reshape(1, -1)


def _plain(comm: Communicator, send: Tensor, fn: ShardFn, info: ShardInfo,
           result: Tensor) -> Handle[Tensor]:
    size, m = send.shape

    def job() -> Tensor:
        recv = torch.empty_like(send)
        comm.await_work(dist.all_to_all_single(recv, send, group=comm.group, async_op=True))
        mine = fn(recv, info).to(send.dtype).contiguous()
        comm.counter.add("shard_map.allgather", comm.allgather_bytes(m * send.element_size()))
        gathered = torch.empty(size * m, dtype=send.dtype, device=send.device)
        comm.await_work(all_gather_flat(gathered, mine, comm.group, async_op=True))
        result.view(-1).copy_(gathered[: info.numel])
        return result

    return comm.submit("shard_map.alltoall", job, comm.alltoall_bytes(send.numel()
                                                                      * send.element_size()))


def _compressed(comm: Communicator, rows: Tensor, fn: ShardFn, info: ShardInfo,
                result: Tensor, compressor: Compressor,
                gens: tuple[torch.Generator | None, torch.Generator | None]) -> Handle[Tensor]:
    size, m = rows.shape
    first = [compressor.compress(rows[j].contiguous(), gens[0]) for j in range(size)]
    nbytes = first[0].nbytes  # every shard has the same length, hence the same layout
    send = torch.cat([p.to_buffer() for p in first])

    def job() -> Tensor:
        recv = torch.empty_like(send)
        comm.await_work(dist.all_to_all_single(recv, send, group=comm.group, async_op=True))
        copies = torch.empty(size, m, dtype=rows.dtype, device=rows.device)
        for i, buf in enumerate(recv.split(nbytes)):
            compressor.decompress_into(first[0].from_buffer(buf), copies[i])
        mine = fn(copies, info).to(rows.dtype).contiguous()
        reduced = compressor.compress(mine, gens[1])
        buf = reduced.to_buffer()
        comm.counter.add("shard_map.allgather", comm.allgather_bytes(buf.numel()))
        gathered = torch.empty(size * buf.numel(), dtype=buf.dtype, device=buf.device)
        comm.await_work(all_gather_flat(gathered, buf, comm.group, async_op=True))
        _decode(compressor, reduced, gathered.split(buf.numel()), result.view(-1), m)
        return result

    return comm.submit("shard_map.alltoall", job, comm.alltoall_bytes(send.numel()))


def _decode(compressor: Compressor, like: Payload, bufs: tuple[Tensor, ...], flat: Tensor,
            m: int) -> None:
    """Decode shard ``j`` into ``flat[j m : (j+1) m]`` (the last one cut at the end)."""
    spare = torch.empty(m, dtype=flat.dtype, device=flat.device)
    for j, buf in enumerate(bufs):
        dst = flat[j * m:(j + 1) * m]
        if dst.numel() == m:
            compressor.decompress_into(like.from_buffer(buf), dst)
        elif dst.numel():
            dst.copy_(compressor.decompress_into(like.from_buffer(buf), spare)[: dst.numel()])
