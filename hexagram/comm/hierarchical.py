"""Hierarchical allreduce: intra-host reduce -> inter-host allreduce -> intra-host broadcast.

Only one rank per host (the leader, its lowest rank) talks across hosts, so the slow
inter-host links carry ``2 (H-1)/H`` of the tensor per host instead of per rank.

Example:
    >>> groups = HostGroups.from_runtime(hexagram.get_runtime())   # doctest: +SKIP
    >>> hierarchical_allreduce(comm, groups, grad).wait()          # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from hexagram.comm.communicator import Communicator, Deferred, Handle
from hexagram.runtime import Runtime

__all__ = ["HostGroups", "broadcast_from_leader", "hierarchical_allreduce", "reduce_to_leader"]


@dataclass(frozen=True)
class HostGroups:
    """Process groups of a rank's host and of the host leaders.

    Attributes:
        intra: group of the ranks on this host.
        leaders: group of host leaders, ``None`` on non-leaders.
        leader: global rank of this host's leader.
        host_size: ranks on this host; hosts: number of hosts.
    """

    intra: dist.ProcessGroup | None
    leaders: dist.ProcessGroup | None
    leader: int
    host_size: int
    hosts: int

    @classmethod
    def from_runtime(cls, rt: Runtime) -> HostGroups:
        """Create (collectively, on every rank) the groups for ``rt``'s topology."""
        intra, leaders = rt.host_groups()
        mine = next(h for h in rt.hosts if rt.rank in h)
        return cls(intra, leaders, mine[0], len(mine), len(rt.hosts))


def hierarchical_allreduce(comm: Communicator, groups: HostGroups, tensor: Tensor,
                           average: bool = True) -> Handle[Tensor]:
    """Allreduce ``tensor`` in place over all ranks of ``comm`` through host leaders.

    Runs on ``comm``'s issuing thread so its three stages are ordered with every other
    operation of ``comm`` identically on all ranks.
    """
    if comm.size == 1:
        return Handle.completed(tensor, "hierarchical_allreduce")
    n = tensor.numel() * tensor.element_size()
    is_leader = groups.leaders is not None
    sent = 0
    if groups.host_size > 1:
        sent += (groups.host_size - 1) * n if is_leader else n  # reduce in, broadcast out
    if is_leader and groups.hosts > 1:
        sent += 2 * (groups.hosts - 1) * n // groups.hosts

    def job() -> Tensor:
        if average:
            tensor.div_(comm.size)
        if groups.host_size > 1:
            dist.reduce(tensor, dst=groups.leader, group=groups.intra)
        if is_leader and groups.hosts > 1:
            dist.all_reduce(tensor, group=groups.leaders)
        if groups.host_size > 1:
            dist.broadcast(tensor, src=groups.leader, group=groups.intra)
        return tensor

    return comm.submit("hierarchical_allreduce", job, sent)


def reduce_to_leader(intra: Communicator, tensor: Tensor) -> Handle[Tensor]:
    """Sum ``tensor`` over a host's communicator ``intra`` into its leader (group rank 0),
    in place; on other ranks ``tensor`` is left undefined. This rank sends ``n`` bytes
    (the leader none)."""
    if intra.size == 1:
        return Handle.completed(tensor, "intra_reduce")
    n = tensor.numel() * tensor.element_size()

    def job() -> Deferred:
        work = dist.reduce(tensor, dst=intra.global_rank(0), group=intra.group, async_op=True)
        return Deferred(work, lambda: tensor)

    return intra.submit("intra_reduce", job, 0 if intra.rank == 0 else n, inline=True)


def broadcast_from_leader(intra: Communicator, tensor: Tensor) -> Handle[Tensor]:
    """The leader's ``tensor`` into every rank of ``intra``, in place. The leader sends
    ``(host_size - 1) n`` bytes (a flat count, as :func:`hierarchical_allreduce`)."""
    if intra.size == 1:
        return Handle.completed(tensor, "intra_broadcast")
    n = tensor.numel() * tensor.element_size()

    def job() -> Deferred:
        work = dist.broadcast(tensor, src=intra.global_rank(0), group=intra.group,
                              async_op=True)
        return Deferred(work, lambda: tensor)

    return intra.submit("intra_broadcast", job, (intra.size - 1) * n if intra.rank == 0 else 0,
                        inline=True)
