"""Price of a stage's data-parallel gradient sync by a Hexagram algorithm (the cost model's
side of :mod:`hexagram.parallel.relax`).

The wire bytes come from :mod:`hexagram.cost.payload_size` (each compressor's payload from
shapes and config, checked against real payloads by the tests there), the seconds from the
stage mesh's alpha-beta collectives (:meth:`hexagram.parallel.mesh.Mesh.collective`):

| algorithm | collective over ``d`` per tensor | latencies |
|---|---|---|
| allreduce | allreduce of the gradient | per bucket |
| fp16 | allreduce of the 16-bit payload | per tensor |
| powersgd | allreduce of P (rows x r), then of Q (cols x r); dense if not smaller | 2 per bucket |
| topk | allgather of ``d`` payloads ((k,) values + (k,) int32 indices) | per tensor |

"Per bucket": the engine's buckets (:data:`~hexagram.parallel.rules.DP_BUCKET_BYTES`) each
send one message, so a tensor pays its byte share of the bucket's latency; the
compressors' default granularity (``"layer"``) sends one message per tensor.

plus the encode/decode time on the device (memory passes over the gradient; PowerSGD's
three matmuls as FLOPs) and the state it keeps (error-feedback residuals: one gradient-sized
buffer; PowerSGD's Q). Parameter shapes are not in the captured graph, only counts: a
linear's ``(out, in)`` is recovered from its output/input widths, an embedding is priced as
a square matrix (PowerSGD's factors of a tall vocab x hidden table are larger: this
under-prices them by ~2-4x, a few kB against a table of MBs), norms and other parameters
as vectors (never compressed). Each algorithm is priced at the config the planner emits
with it (:data:`PLANNED_OPTIONS`: PowerSGD rank 8, a drop-in for allreduce's loss).

Example:
    >>> from hexagram.parallel.cluster import Cluster
    >>> from hexagram.parallel.mesh import Mesh
    >>> from hexagram.parallel.graph import Op
    >>> slow = Cluster(hosts=2, devices_per_host=1, inter_host_gbps=1, dtype_bytes=4)
    >>> op = Op("linear", "fc", params=1024 * 1024 + 1024, out_elems=1024)
    >>> secs = {a: sync_cost(op, 1024, Mesh(cluster=slow, d=2, t=1, b=1, microbatches=1,
    ...         spans_hosts=True, dp_algorithm=a), 1)[0] for a in PRICED}
    >>> secs["powersgd"] < secs["fp16"] < secs["allreduce"]
    True
"""

from __future__ import annotations

import math
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any

import torch

from hexagram.algorithms import registry
from hexagram.compress.base import Compressor
from hexagram.cost.payload_size import payload_layout
from hexagram.errors import ConfigError
from hexagram.parallel.rules import DP_BUCKET_BYTES, PRICED, check_priced

if TYPE_CHECKING:
    from hexagram.parallel.graph import Op
    from hexagram.parallel.mesh import Mesh

__all__ = ["PLANNED_OPTIONS", "PRICED", "check_priced", "frozen_options", "op_shapes",
           "planned_options", "sync_cost", "wire_bytes"]

#: the config the planner prices *and* emits (``StagePlan.dp_options``) per algorithm: one
#: that trains like allreduce as a drop-in, which each registry entry declares
#: (``Entry.planner``; PowerSGD: rank 8 with its warm-up; others: their registry defaults)
PLANNED_OPTIONS: dict[str, dict[str, Any]] = registry.planner_options()
_DTYPE = {1: torch.float16, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def planned_options(name: str) -> dict[str, Any]:
    """The ``dp_options`` the planner emits for a stage synchronised by ``name`` (a copy;
    ``{}`` = the registry default), the same config :func:`sync_cost` prices.

    >>> planned_options("powersgd")
    {'rank': 8, 'start_iter': 10}
    """
    return dict(PLANNED_OPTIONS.get(name, {}))


#: a config as a cache key: sorted ``(field, value)`` pairs; ``None``: the planned config
Options = tuple[tuple[str, Any], ...] | None


def frozen_options(options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """``options`` (``StagePlan.dp_options``) as sorted pairs, lists as tuples (hashable).

    >>> frozen_options({"start_iter": 10, "rank": 4})
    (('rank', 4), ('start_iter', 10))
    """
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                        for k, v in options.items()))


@cache
def _compressor(name: str, options: Options = None) -> Compressor | None:
    config = planned_options(name) if options is None else dict(options)
    return getattr(registry.get(name, **config), "compressor", None)


def op_shapes(op: Op, in_elems: float, psplit: int) -> list[tuple[int, ...]]:
    """Shapes of an operator's parameter tensors on one device (``psplit``: tp shards)."""
    n = op.params / psplit
    if op.kind == "linear" and in_elems > 0 and op.out_elems > 0:
        ratio = op.out_elems / in_elems  # out_features / in_features
        cols = max(1, round(math.sqrt(op.params / ratio)))
        out = max(1, round(ratio * cols))
        weight = (max(1, out // psplit), cols)
        bias = op.params - out * cols
        return [weight, (max(1, out // psplit),)] if bias * 2 >= out else [weight]
    if op.kind == "embedding":
        side = max(1, math.isqrt(int(n)))
        return [(side, max(1, int(n) // side))]
    return [(max(1, int(n)),)]


@lru_cache(maxsize=65536)
def wire_bytes(name: str, shape: tuple[int, ...], dtype_bytes: int, options: Options = None
               ) -> tuple[float, ...]:
    """Bytes of each message one rank contributes for a gradient of ``shape`` (PowerSGD: P,
    then Q; the others: one message), from :func:`~hexagram.cost.payload_size.payload_layout`;
    ``options``: the algorithm's config (:func:`frozen_options`; default: the planned one)."""
    dense = (float(math.prod(shape) * dtype_bytes),)
    comp = _compressor(name, options)
    if comp is None:
        return dense
    if name == "powersgd" and (len(shape) < 2 or not comp.worthwhile(  # type: ignore[attr-defined]
            torch.Size(shape))):
        return dense  # sent uncompressed in the P message
    layout = payload_layout(comp, shape, _DTYPE[dtype_bytes])
    if layout is None:
        return dense
    sizes = tuple(float(math.prod(s) * d.itemsize) for s, d in layout)
    return sizes if name == "powersgd" else (sum(sizes),)


def _encode_seconds(name: str, shape: tuple[int, ...], mesh: Mesh) -> float:
    c, n = mesh.cluster, math.prod(shape)
    comp = _compressor(name, mesh.dp_options)
    if comp is None:
        return 0.0
    if comp.memory_passes is None:
        raise ConfigError(f"{name}: its compressor {comp.name!r} declares no memory_passes; "
                          "the planner cannot price its encode (set memory_passes on the class)")
    # passes over the gradient to encode + decode (read/write): the compressor's declaration,
    # at the device's memory rate in the one hardware description
    hw = c.hardware
    secs = comp.memory_passes * n * 4 / hw.memory_bps + c.op_overhead_us * 1e-6
    if name == "powersgd" and len(shape) >= 2:  # M Q, M^T P, P Q^T
        rank = _compressor(name, mesh.dp_options).config.rank  # type: ignore[union-attr]
        secs += 6.0 * n * rank / hw.flops
    return secs


def sync_cost(op: Op, in_elems: float, mesh: Mesh, psplit: int) -> tuple[float, float]:
    """(seconds per step to synchronise ``op``'s gradients over the mesh's ``d`` axis by
    ``mesh.dp_algorithm``, extra state bytes per device it keeps)."""
    name, c = mesh.dp_algorithm, mesh.cluster
    secs = extra = 0.0
    for shape in op_shapes(op, in_elems, psplit):
        msgs = wire_bytes(name, shape, c.dtype_bytes, mesh.dp_options)
        if name == "topk":
            secs += mesh.collective("allgather", "d", msgs[0] * mesh.d)
        elif name in ("allreduce", "powersgd"):  # a bucket's one allreduce (PowerSGD: P, Q)
            share = math.prod(shape) * c.dtype_bytes / DP_BUCKET_BYTES
            secs += sum(mesh.collective("allreduce", "d", b, share) for b in msgs)
        else:  # per-tensor segments (the compressors' default granularity, "layer")
            secs += sum(mesh.collective("allreduce", "d", b) for b in msgs)
        secs += _encode_seconds(name, shape, mesh)
        if name == "topk" or (name == "powersgd" and len(msgs) == 2):
            extra += math.prod(shape) * c.dtype_bytes  # error-feedback residual
            if name == "powersgd":
                extra += msgs[-1]  # warm-start Q
    return secs, extra
