"""The links inside a host and between hosts, measured apart in a running multi-host job.

A job's allreduce over every rank mixes both links: on 2 hosts of 2 ranks, a ring crosses
the network twice and the host's loopback (or NVLink) twice, and one alpha-beta fit of it
prices neither. :func:`fit_host_links` fits them apart, the way the cost model uses them
(:meth:`hexagram.parallel.cluster.Cluster.link`):

- ``intra_*``: each host's ranks allreduce among themselves, every host at once (each its
  own group, so hosts do not wait on each other); the slowest host's fit counts (largest
  latency, lowest rate), the same on every rank;
- ``inter_*``: one rank per host (its local rank 0) allreduces with the other hosts' while
  the rest wait: the host's network rate, which the cost model shares among the host's
  data-parallel rings.

Ranks are laid out as torchrun lays them out: host ``h`` holds ranks
``h * per_host ... (h + 1) * per_host - 1``.

Example:
    >>> links = fit_host_links(per_host=2)                        # doctest: +SKIP
    >>> links["inter_gbps"] < links["intra_gbps"]                 # doctest: +SKIP
    True
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hexagram.comm.device import group_device
from hexagram.cost.links import fit_links
from hexagram.errors import HexagramError
from hexagram.parallel.cluster import Cluster

__all__ = ["KEYS", "fit_host_links", "on_hosts"]

KEYS = ("intra_latency_us", "intra_gbps", "inter_latency_us", "inter_gbps")


def fit_host_links(per_host: int, repeat: int = 5, stat: str = "median") -> dict[str, float]:
    """Alpha (us) and rate (Gbit/s) of the link inside a host and of the network between
    hosts (collective: every rank calls it; see the module doc). One host, or one rank per
    host: the one link there is, for both.

    Raises:
        HexagramError: ``per_host`` does not divide the world size.
    """
    world = dist.get_world_size()
    if per_host < 1 or world % per_host:
        raise HexagramError(f"{world} ranks do not split into hosts of {per_host}; pass the "
                            f"ranks per host (LOCAL_WORLD_SIZE) that divides the world size")
    if per_host in (1, world):
        one = fit_links(repeat=repeat, stat=stat)
        return dict(zip(KEYS, (one["latency_us"], one["gbps"]) * 2))
    hosts = range(world // per_host)
    mine, _ = dist.new_subgroups_by_enumeration(
        [list(range(h * per_host, (h + 1) * per_host)) for h in hosts])
    leaders = dist.new_group([h * per_host for h in hosts])
    intra = fit_links(repeat=repeat, group=mine, stat=stat)
    inter = {"latency_us": 0.0, "gbps": 0.0}
    if dist.get_rank() % per_host == 0:
        inter = fit_links(repeat=repeat, group=leaders, stat=stat)
    # the slowest host's link inside; the leaders' network fit, sent to every rank
    dev = group_device(None)
    inside = torch.tensor([intra["latency_us"], -intra["gbps"]], dtype=torch.float64,
                          device=dev)
    network = torch.tensor([inter["latency_us"], inter["gbps"]], dtype=torch.float64,
                           device=dev)
    dist.all_reduce(inside, op=dist.ReduceOp.MAX)
    dist.broadcast(network, src=0)
    for group in (mine, leaders):
        if group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
            dist.destroy_process_group(group)
    return dict(zip(KEYS, (float(inside[0]), -float(inside[1]), float(network[0]),
                           float(network[1]))))


def on_hosts(cluster: Cluster, figures: dict[str, float], per_host: int) -> Cluster:
    """``cluster`` (all ranks on one host, as :func:`~hexagram.parallel.calibrate.calibrated`
    builds it) laid out as ``per_host`` ranks per host with the two fitted links of
    ``figures``; unchanged where ``figures`` has no such fit (one host).

    Example:
        >>> c = on_hosts(Cluster(devices_per_host=4), {"intra_latency_us": 20.0,
        ...     "intra_gbps": 50.0, "inter_latency_us": 300.0, "inter_gbps": 0.1}, 2)
        >>> c.hosts, c.devices_per_host, c.link(True)[1] * 8 / 1e9
        (2, 2, 0.1)
    """
    if not all(k in figures for k in KEYS) or not 0 < per_host < cluster.devices:
        return cluster
    return cluster.replace(hosts=cluster.devices // per_host, devices_per_host=per_host,
                           intra_latency_us=figures["intra_latency_us"],
                           intra_host_gbps=figures["intra_gbps"],
                           inter_latency_us=figures["inter_latency_us"],
                           inter_host_gbps=figures["inter_gbps"])
