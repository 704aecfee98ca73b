"""The executor's exact data-parallel gradient sync, and its cost measured on the job.

A stage's gradients are averaged over its ``dp`` ranks in buckets of
:data:`~hexagram.parallel.rules.DP_BUCKET_BYTES` (:func:`grad_buckets`, :func:`allreduce_mean`):
one allreduce per bucket, as PyTorch DDP does, so the link latency is paid per bucket, not
per parameter tensor. :func:`measure_dp_sync` times that very sync of a model's gradients
on the running job's ranks against the cost model's price of the same buckets: the ratio
(``dp_sync_scale``) prices what the alpha-beta fit of a microbenchmark misses (the copies
into and out of the bucket, ranks sharing cores), as ``compute_scale`` does for compute.

Example:
    >>> import torch
    >>> [len(b) for b in grad_buckets([torch.zeros(4), torch.zeros(4)], cap=16)]
    [1, 1]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hexagram.buckets import group_tensors
from hexagram.cost.stopwatch import synchronous_time
from hexagram.parallel.cluster import Cluster
from hexagram.parallel.mesh import Mesh
from hexagram.parallel.rules import DP_BUCKET_BYTES

__all__ = ["allreduce_mean", "grad_buckets", "measure_dp_sync", "sync_price"]


def grad_buckets(grads: list[torch.Tensor], cap: int = DP_BUCKET_BYTES
                 ) -> list[list[torch.Tensor]]:
    """``grads`` in order, grouped per dtype and device into buckets of about ``cap`` bytes
    (the engine's rule, :func:`hexagram.buckets.group_tensors`)."""
    return [[grads[k] for k in g] for g in group_tensors(grads, cap)]


def allreduce_mean(grads: list[torch.Tensor], group: dist.ProcessGroup | None, ranks: int
                   ) -> None:
    """Average ``grads`` in place over ``group`` (``ranks`` members), one allreduce per
    :func:`grad_buckets` bucket; every rank passes the same shapes in the same order."""
    for bucket in grad_buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(ranks)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def sync_price(cluster: Cluster, nbytes: float, ranks: int | None = None) -> float:
    """The cost model's seconds of the exact data-parallel sync of ``nbytes`` of gradients
    over ``ranks`` (default: every device of ``cluster``; one ``d`` axis, over the cluster's
    hosts when it has several), in buckets of
    :data:`~hexagram.parallel.rules.DP_BUCKET_BYTES`: what :func:`measure_dp_sync` divides
    the measured sync by.

    Example:
        >>> one = Cluster(hosts=1, devices_per_host=4, intra_latency_us=10.0)
        >>> two = one.replace(hosts=2, devices_per_host=2, inter_latency_us=1000.0)
        >>> sync_price(two, 4e3) > 10 * sync_price(one, 4e3)  # the ring crosses the network
        True
    """
    mesh = Mesh(cluster=cluster, d=ranks or cluster.devices, t=1, b=1, microbatches=1,
                spans_hosts=cluster.hosts > 1)
    return mesh.collective("allreduce", "d", nbytes, nbytes / DP_BUCKET_BYTES)


def measure_dp_sync(model: nn.Module, cluster: Cluster, device: torch.device,
                    repeat: int = 7) -> dict[str, float]:
    """Collective over the job: :func:`allreduce_mean` of gradients shaped as ``model``'s
    parameters (those that train), over every rank, ``repeat`` times from a barrier.
    Returns ``dp_sync_ms`` (per call the slowest rank, the median over calls:
    :func:`~hexagram.cost.stopwatch.synchronous_time`) and ``dp_sync_scale``:
    that, over ``cluster``'s price of the same sync (:func:`sync_price`: one ``d`` axis
    over every rank, laid out on the cluster's hosts). One rank: ``{}``.

    Example:
        >>> measure_dp_sync(model, calibrated(figures, 2, torch.float64), device)
        ... # doctest: +SKIP
        {'dp_sync_ms': 17.3, 'dp_sync_scale': 2.4}
    """
    world = dist.get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    if world == 1 or not params:
        return {}
    grads = [torch.zeros(p.shape, dtype=p.dtype, device=device) for p in params]

    def sync() -> None:
        allreduce_mean(grads, None, world)
        if device.type == "cuda":  # NCCL returns before the stream has run
            torch.cuda.synchronize(device)

    measured = synchronous_time(sync, repeat)
    priced = sync_price(cluster, float(sum(g.numel() * g.element_size() for g in grads)),
                        world)
    return {"dp_sync_ms": measured * 1e3,
            "dp_sync_scale": measured / priced if priced > 0 else 1.0}
