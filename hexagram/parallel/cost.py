"""Cost model: compute (roofline), alpha-beta collectives per mesh axis, memory.

A stage runs on a logical ``d x t`` mesh: the batch is split over ``d`` (data parallel,
optionally ZeRO-sharded parameters), operators choose a layout over ``t`` (tensor parallel).
Activation layouts over ``t``: ``R`` replicated, ``S`` sharded on the feature dimension,
``P`` partial sums (the output of a row-split matmul).

The mesh and the price of its collectives are :mod:`hexagram.parallel.mesh`'s
(:class:`Mesh` stays importable from here).

Example:
    >>> from hexagram.parallel.cluster import Cluster
    >>> m = Mesh(cluster=Cluster(hosts=1, devices_per_host=8), d=2, t=4, b=4, microbatches=1)
    >>> layer = Layer("fc", [Op("linear", "fc", params=72, out_elems=8, flops=128)])
    >>> sorted({s.name for s in strategies(layer, 0, m)})
    ['colwise', 'replicate', 'rowwise']
"""

from __future__ import annotations

from dataclasses import dataclass

from hexagram.parallel.cluster import Cluster, Submesh
from hexagram.parallel.graph import Layer, Op
from hexagram.parallel.mesh import Mesh
from hexagram.parallel.rules import DP_BUCKET_BYTES

__all__ = ["Mesh", "Strategy", "edge_cost", "logical_meshes", "strategies"]


@dataclass(frozen=True)
class Strategy:
    """One way to run an operator: layouts over ``t``, ZeRO over ``d``, costs and memory.

    ``time`` is per micro-batch plus the per-step gradient sync divided by #micro-batches;
    ``state`` bytes are parameters + gradients + optimizer state, ``act`` saved activations
    of one micro-batch.
    """

    name: str
    in_layout: str
    out_layout: str
    zero: bool
    time: float
    state: float
    act: float


def _param_costs(op: Op, mesh: Mesh, psplit: int, zero: bool,
                 in_elems: float = 0.0) -> tuple[float, float]:
    """(seconds per micro-batch incl. amortised sync, state bytes) of an op's parameters."""
    c = mesh.cluster
    pbytes = op.params * c.dtype_bytes / psplit
    state = op.params * (2 * c.dtype_bytes + c.optimizer_bytes) / psplit
    if mesh.dp_algorithm != "allreduce" and not zero and mesh.d > 1:  # a relaxed dp sync
        from hexagram.parallel.relax_cost import sync_cost
        sync, extra = sync_cost(op, in_elems, mesh, psplit)
        return sync / mesh.microbatches, state + extra
    if not zero or mesh.d == 1:  # in the executor's buckets: a byte share of one latency
        sync = mesh.collective("allreduce", "d", pbytes, pbytes / DP_BUCKET_BYTES)
        return sync * c.dp_sync_scale / mesh.microbatches, state
    # ZeRO-3: gather parameters for forward and backward, reduce-scatter gradients once;
    # the module is one FSDP unit (its tensors travel flattened together)
    per_mb = 2 * mesh.collective("allgather", "d", pbytes) + c.zero_overhead_us * 1e-6
    return per_mb + mesh.collective(c.zero_grad_collective, "d", pbytes) / mesh.microbatches, \
        state / mesh.d


def _make(op: Op, in_elems: float, mesh: Mesh, name: str, layouts: tuple[str, str],
          zero: bool) -> Strategy:
    c, b = mesh.cluster, mesh.b
    split = mesh.t if name in ("colwise", "rowwise", "sharded") else 1
    psplit = mesh.t if name in ("colwise", "rowwise") else 1
    moved = (op.out_elems * b + op.out_const + in_elems * b) * c.dtype_bytes / split \
        + op.params * c.dtype_bytes / psplit
    time = mesh.compute(op.flops * b / split, moved) if op.kind not in ("input", "view") else 0.0
    if name == "colwise":  # backward: the replicated input's gradient is partial -> allreduce
        time += mesh.collective("allreduce", "t", in_elems * b * c.dtype_bytes)
    if psplit > 1:  # DTensor's per-call dispatch and redistribute work (measured)
        time += c.tp_overhead_us * 1e-6
    sync, state = _param_costs(op, mesh, psplit, zero, in_elems) if op.params else (0.0, 0.0)
    act = (op.out_elems * b / (mesh.t if layouts[1] == "S" else 1) + op.out_const) \
        * c.dtype_bytes if op.kind not in ("input", "view") else 0.0
    return Strategy(name, layouts[0], layouts[1], zero, time + sync, state, act)


def strategies(layer: Layer, i: int, mesh: Mesh) -> list[Strategy]:
    """Candidate strategies of operator ``i`` of ``layer`` on ``mesh``."""
    op = layer.ops[i]
    in_elems = layer.ops[op.inputs[0]].out_elems if op.inputs else 0.0
    if op.kind == "linear" and mesh.t > 1:
        kinds = [("replicate", ("R", "R")), ("colwise", ("R", "S")), ("rowwise", ("S", "P"))]
    elif op.kind in ("elementwise", "view", "attention") and mesh.t > 1:
        kinds = [("replicate", ("R", "R")), ("sharded", ("S", "S"))]
    else:  # input, source, norm, embedding, unknown: replicated over t
        kinds = [("replicate", ("R", "R"))]
    zeros = (False, True) if op.params and mesh.d > 1 and mesh.zero else (False,)
    return [_make(op, in_elems, mesh, name, lay, z) for name, lay in kinds for z in zeros]


def edge_cost(src: str, dst: str, elems: float, mesh: Mesh) -> float:
    """Seconds (forward + backward, one micro-batch) to turn layout ``src`` into ``dst``."""
    if src == dst:
        return 0.0
    nbytes = elems * mesh.b * mesh.cluster.dtype_bytes
    gather = mesh.collective("allgather", "t", nbytes)
    if src == "R" or src == "S":  # R->S: backward gathers the gradient; S->R: forward gathers
        # a DTensor redistribute of its own (PrepareModuleInput/Output): one more call's
        # overhead; P->* is folded into the row-wise linear that produced P
        return gather + mesh.cluster.tp_overhead_us * 1e-6
    if dst == "R":  # P->R
        return mesh.collective("allreduce", "t", nbytes)
    return mesh.collective("reduce_scatter", "t", nbytes) + gather  # P->S


def logical_meshes(sub: Submesh, cluster: Cluster) -> list[tuple[int, int]]:
    """(d, t) factorisations of a submesh with ``t`` inside one host."""
    n = sub.devices
    return [(n // t, t) for t in range(1, n + 1)
            if n % t == 0 and t <= cluster.devices_per_host and sub.per_host % t == 0]
