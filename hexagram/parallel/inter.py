"""Inter-operator pass: dynamic programming over stage boundaries and submeshes (Alpa).

For ``B`` micro-batches, a pipeline's step time is ``sum(stage latencies) + (B - 1) x
max(stage latency)``. Alpa's DP fixes a bound ``t_max`` on the slowest stage, then
``F[s][i][n]`` = least sum of latencies of ``s`` stages covering layers ``i..L-1`` on ``n``
devices, each stage a contiguous layer range on a submesh with its best intra-op option
that fits in memory (the ``s``-th stage from the end holds ``min(s, B)`` micro-batches of
activations under 1F1B, ``B`` under GPipe). ``t_max`` runs over the distinct stage
latencies in increasing order and stops once ``B x t_max`` cannot beat the best plan.

Example:
    >>> # see hexagram.parallel.planner.plan, which builds the tables and calls solve()
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hexagram.parallel.cluster import Cluster, Constraints, Submesh
from hexagram.parallel.cost import Mesh, logical_meshes
from hexagram.parallel.graph import ModelGraph
from hexagram.parallel.intra import LayerOption, fastest, layer_options

__all__ = ["StageChoice", "Tables", "build_tables", "core_factor", "solve", "step_time",
           "transfer_time"]


@dataclass(frozen=True)
class StageChoice:
    """A stage: layers ``[start, end)`` on ``sub`` as a ``d x t`` mesh, per-layer options."""

    start: int
    end: int
    sub: Submesh
    mesh: Mesh
    options: tuple[LayerOption, ...]
    latency: float
    memory: float


@dataclass
class Tables:
    """Best stage latency ``cost[q, sub, i, j]`` for ``q`` in-flight micro-batches."""

    microbatches: int
    subs: list[Submesh]
    inflight: list[int]
    cost: np.ndarray                      # [Q, nsub, L+1, L+1] seconds (inf: impossible)
    arg: np.ndarray                       # [Q, nsub, L+1, L+1] index into ``configs``
    configs: list[tuple[Mesh, list[list[LayerOption]], int]]  # mesh, options, option index
    memory: np.ndarray                    # [Q, nsub, L+1, L+1] bytes of the chosen config
    cluster: Cluster | None = None        # its measured overheads enter :func:`step_time`


def step_time(latencies: list[float], microbatches: int, cluster: Cluster | None = None,
              devices: list[int] | None = None) -> float:
    """Seconds of one step of a pipeline whose stages take ``latencies`` per micro-batch:
    ``sum + (B - 1) max``, times the core-sharing factor of :func:`core_factor` (stage
    ``k`` on ``devices[k]`` ranks, default: the cluster's devices split evenly), plus the
    cluster's measured overheads: pipelining's per micro-batch and stage cost on each of
    the ``S + B - 1`` slots of the critical path (pipelines only: one stage runs no
    pipelining) and the per-step cost.

    Example:
        >>> step_time([1.0, 2.0], 4)
        9.0
        >>> c = Cluster(hosts=1, devices_per_host=4, cores_per_host=2)
        >>> step_time([1.0, 1.0, 1.0, 1.0], 4, c)   # 7 slots busy 1,2,3,4,3,2,1: x 9/14
        4.5
    """
    total = sum(latencies) + (microbatches - 1) * max(latencies)
    if cluster is None:
        return total
    total *= core_factor(latencies, microbatches, cluster, devices)
    if len(latencies) > 1:
        total += (len(latencies) + microbatches - 1) * cluster.microbatch_overhead_us * 1e-6
    return total + cluster.step_overhead_us * 1e-6


def core_factor(latencies: list[float], microbatches: int, cluster: Cluster,
                devices: list[int] | None = None) -> float:
    """Step time with ranks idle in the bubble over the step time priced with every rank
    busy (the compute fields are measured so: ``overheads.model_compute_scale``).

    The pipeline runs in ``S + B - 1`` slots; in slot ``k`` the stages ``s`` with
    ``0 <= k - s < B`` compute. The slot lasts ``w = max`` of their latencies and keeps
    ``busy = sum(devices_s x latency_s) / w`` ranks busy on average, who run
    ``cluster.sharing(busy)`` times slower than alone. The factor is ``sum(w x
    sharing(busy)) / (sum(w) x sharing(devices_per_host))``: 1 for one stage and for a
    cluster without ``cores_per_host``, below 1 for a pipeline on shared cores. Stage ``k``
    runs on ``devices[k]`` ranks (default: the cluster's devices split evenly).

    Example:
        >>> c = Cluster(hosts=1, devices_per_host=4, cores_per_host=2)
        >>> core_factor([1.0, 1.0], 4, c), core_factor([1.0], 4, c)  # slots busy 2,4,4,4,2
        (0.8, 1.0)
    """
    if not cluster.cores_per_host or len(latencies) == 1 or max(latencies) <= 0:
        return 1.0
    if devices is None:
        devices = [cluster.devices // len(latencies)] * len(latencies)
    if len(devices) != len(latencies):
        raise ValueError(f"core_factor: {len(devices)} device counts for "
                         f"{len(latencies)} stages; give one per stage")
    priced = slowed = 0.0
    for k in range(len(latencies) + microbatches - 1):
        active = [s for s in range(len(latencies)) if 0 <= k - s < microbatches]
        w = max(latencies[s] for s in active)
        if w <= 0:
            continue
        busy = sum(devices[s] * latencies[s] for s in active) / w / cluster.hosts
        priced += w
        slowed += w * cluster.sharing(busy)
    return slowed / (priced * cluster.sharing(cluster.devices_per_host)) if priced else 1.0


def transfer_time(cluster: Cluster, sub: Submesh, nbytes: float) -> float:
    """Forward activation + backward gradient between consecutive stages (one micro-batch).

    Stages smaller than a host are packed several to a host, so only a fraction of their
    boundaries cross the inter-host link."""
    if nbytes <= 0:
        return 0.0
    p_inter = 0.0 if cluster.hosts == 1 else min(1.0, sub.devices / cluster.devices_per_host)
    t = [(a + nbytes / w) for a, w in (cluster.link(False), cluster.link(True))]
    return 2.0 * ((1 - p_inter) * t[0] + p_inter * t[1])


def _layer_table(graph: ModelGraph, mesh: Mesh, inflight: int,
                 cache: dict) -> list[list[LayerOption]]:
    """Per layer its options on ``mesh``; only the fastest when the whole model fits with it
    (then no stage ever needs a smaller option, and the extra ILPs are skipped)."""
    fast = []
    for layer in graph.layers:
        key = ("fast", layer.signature(), mesh)
        if key not in cache:
            cache[key] = fastest(layer, mesh)
        fast.append(cache[key])
    if sum(o.state + inflight * o.act for o in fast) <= mesh.cluster.memory_bytes:
        return [[o] for o in fast]
    out = []
    for layer, best in zip(graph.layers, fast):
        key = ("all", layer.signature(), mesh)
        if key not in cache:
            cache[key] = layer_options(layer, mesh, best=best)
        out.append(cache[key])
    return out


def _meshes(graph: ModelGraph, cluster: Cluster, cons: Constraints, b_mb: int,
            sub: Submesh) -> list[Mesh]:
    out = []
    for d, t in logical_meshes(sub, cluster):
        if (cons.tp and t != cons.tp) or (cons.dp and d != cons.dp) or b_mb % d:
            continue
        for algo in cons.dp_algorithms if d > 1 else ("allreduce",):  # dp sync choices
            out.append(Mesh(cluster=cluster, d=d, t=t, b=b_mb // d, dp_algorithm=algo,
                            microbatches=graph.batch // b_mb, spans_hosts=sub.hosts > 1,
                            zero=cons.zero))
    return out


def _range_sums(picks: list[LayerOption]) -> tuple[np.ndarray, ...]:
    """(time, state, act) summed over every layer range ``[i, j)``: ``[L+1, L+1]`` each."""
    cum = [np.concatenate([[0.0], np.cumsum([getattr(o, f) for o in picks])])
           for f in ("time", "state", "act")]
    return tuple(c[None, :] - c[:, None] for c in cum)


def _admit(tables: Tables, si: int, picks: list[LayerOption], send: np.ndarray,
           memory_bytes: float) -> None:
    """Keep, per range and in-flight count, the config (last in ``configs``) if faster."""
    lat, state, act = _range_sums(picks)
    lat = lat + send[None, :]  # forward activation + backward gradient to the next stage
    idx = np.arange(lat.shape[0])
    for qi, q in enumerate(tables.inflight):
        mem = state + q * act
        better = (mem <= memory_bytes) & (idx[None, :] > idx[:, None]) & \
            (lat < tables.cost[qi, si])
        tables.cost[qi, si][better] = lat[better]
        tables.memory[qi, si][better] = mem[better]
        tables.arg[qi, si][better] = len(tables.configs) - 1


def build_tables(graph: ModelGraph, cluster: Cluster, cons: Constraints, microbatches: int,
                 cache: dict) -> Tables:
    """Stage latency and memory of every (layer range, submesh, in-flight count)."""
    n_layers, b_mb = len(graph.layers), graph.batch // microbatches
    subs = cluster.submeshes()
    max_stages = cons.pp or min(n_layers, cluster.devices)
    inflight = [microbatches] if cons.schedule == "gpipe" else \
        list(range(1, min(max_stages, microbatches) + 1))
    shape = (len(inflight), len(subs), n_layers + 1, n_layers + 1)
    tables = Tables(microbatches, subs, inflight, np.full(shape, np.inf),
                    np.zeros(shape, dtype=np.int64), [], np.full(shape, np.inf), cluster)
    out_bytes = [0.0] + [layer.out_elems * b_mb * cluster.dtype_bytes for layer in graph.layers]
    for si, sub in enumerate(subs):
        send = np.array([transfer_time(cluster, sub, x) for x in out_bytes])
        send[-1] = 0.0  # the last stage sends nothing
        for mesh in _meshes(graph, cluster, cons, b_mb, sub):
            table = _layer_table(graph, mesh, max(inflight), cache)
            for k in range(max(len(opts) for opts in table)):
                tables.configs.append((mesh, table, k))
                _admit(tables, si, [opts[min(k, len(opts) - 1)] for opts in table], send,
                       cluster.memory_bytes)
    return tables


def _dp(tables: Tables, t_max: float, devices: int, stage_counts: list[int]
        ) -> tuple[np.ndarray, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """F[s, i, n] under the bound, and per s the argmin (next boundary, submesh)."""
    n_layers = tables.cost.shape[-1] - 1
    top = max(stage_counts)
    f = np.full((top + 1, n_layers + 1, devices + 1), np.inf)
    f[0, n_layers, 0] = 0.0
    choice = {}
    for s in range(1, top + 1):
        qi = min(s, len(tables.inflight)) - 1
        best = np.full((n_layers + 1, devices + 1), np.inf)
        bj = np.zeros_like(best, dtype=np.int64)
        bsub = np.zeros_like(bj)
        for si, sub in enumerate(tables.subs):
            n = sub.devices
            if n > devices:
                continue
            c = np.where(tables.cost[qi, si] <= t_max, tables.cost[qi, si], np.inf)
            g = np.full((devices + 1, n_layers + 1), np.inf)   # g[n', j] = F[s-1][j, n' - n]
            g[n:, :] = f[s - 1][:, : devices + 1 - n].T
            cand = c[:, None, :] + g[None, :, :]          # [i, n', j]
            j = np.argmin(cand, axis=2)
            val = np.take_along_axis(cand, j[:, :, None], axis=2)[:, :, 0]
            better = val < best
            best[better], bj[better], bsub[better] = val[better], j[better], si
        f[s], choice[s] = best, (bj, bsub)
    return f, choice


def _rebuild(tables: Tables, choice: dict, s: int, devices: int) -> list[StageChoice]:
    stages, i, n = [], 0, devices
    for left in range(s, 0, -1):
        bj, bsub = choice[left]
        j, si = int(bj[i, n]), int(bsub[i, n])
        qi = min(left, len(tables.inflight)) - 1
        mesh, table, k = tables.configs[int(tables.arg[qi, si, i, j])]
        opts = tuple(table[layer][min(k, len(table[layer]) - 1)] for layer in range(i, j))
        stages.append(StageChoice(i, j, tables.subs[si], mesh, opts,
                                  float(tables.cost[qi, si, i, j]),
                                  float(tables.memory[qi, si, i, j])))
        i, n = j, n - tables.subs[si].devices
    return stages


def _bounds(tables: Tables, eps: float) -> list[float]:
    vals = np.unique(tables.cost[np.isfinite(tables.cost)])
    if tables.microbatches == 1 or len(vals) == 0:
        return [np.inf]
    out: list[float] = []
    start = 0.0
    for v in vals:  # one bound per (1 + eps) bucket of latencies: the bucket's largest value
        if out and v <= start * (1 + eps):
            out[-1] = float(v)
        else:
            out.append(float(v))
            start = float(v)
    return out


def solve(tables: Tables, devices: int, stage_counts: list[int], eps: float = 0.1
          ) -> tuple[float, list[StageChoice]] | None:
    """Best pipeline (step seconds, stages) using all ``devices``; None if nothing fits."""
    b = tables.microbatches
    best: tuple[float, list[StageChoice]] | None = None
    for t_max in _bounds(tables, eps):
        if best is not None and b * t_max >= best[0]:
            break  # every plan left has its slowest stage above t_max
        f, choice = _dp(tables, t_max, devices, stage_counts)
        for s in stage_counts:
            if s < f.shape[0] and np.isfinite(f[s, 0, devices]):
                stages = _rebuild(tables, choice, s, devices)
                total = step_time([st.latency for st in stages], b, tables.cluster,
                                  [st.sub.devices for st in stages])
                if best is None or total < best[0]:
                    best = (total, stages)
    return best
