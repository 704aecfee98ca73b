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

from hexagram.comm.communicator import Communicator, Handle
from hexagram.runtime import Runtime

__all__ = ["HostGroups", "hierarchical_allreduce"]


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
