"""Collective schedules as alpha-beta time formulas, and the schedule each backend picks.

Every formula gives the seconds one rank spends in a collective on a :class:`Topology`:
``P = hosts x d`` ranks numbered host-major (ranks ``0..d-1`` on host 0, ...), a link
inside a host (rate ``B_a``, latency ``a``) and a host uplink (rate ``B_e``, latency ``e``).
A *hop* between two ranks at distance ``s`` stays inside a host when ``s < d``; when every
rank of a host talks across at once (butterflies: recursive doubling, halving-doubling,
gTop-k's exchange), the ``d`` flows share the uplink, so each gets ``B_e / d``. Ring and
tree schedules cross each host boundary with one flow, at ``min(B_a, B_e)``.

| schedule | latency | bytes sent per rank |
|---|---|---|
| ring allreduce | ``2 (P-H) a + 2 (H-1) e`` | ``2 (P-1)/P n`` |
| tree allreduce (NCCL's double binary tree) | ``2 ((d-1) a + ceil(log2 H) e)`` | ``2 n`` |
| recursive doubling allreduce | ``log2 P`` hops | ``n log2 P`` |
| halving-doubling allreduce (Rabenseifner) | ``2 log2 P`` hops | ``2 (P-1)/P n`` |
| ring allgather (``m`` per rank) | ``(P-H) a + (H-1) e`` | ``(P-1) m`` |
| ring reduce-scatter | ``(P-H) a + (H-1) e`` | ``(P-1)/P n`` |
| recursive doubling allgather | ``log2 P`` hops | ``(P-1) m`` |
| hierarchical allreduce | ``2 a`` + leaders' allreduce | ``2 (d-1) n`` in the host + leaders' |
| gTop-k (``k`` pairs) | ``log2 P`` hops (binomial tree: ``2 ceil(log2 P)``) | ``k`` pairs a hop |

The tree's rate is 0.9 of the ring's (NCCL's factor). Non-powers of two: recursive doubling
and halving-doubling fold the extra ranks in with two more full-size hops (MPICH's rule).
Which schedule runs (:func:`choose`):

- ``nccl``: allreduce takes the faster of ring and tree by this latency-bandwidth model,
  as NCCL's tuner does (``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and
  ``ncclTopoGetAlgoTime``: ring latency ``(nsteps - nInterSteps) intraLat + nInterSteps
  interLat`` with ``nsteps = 2 (P-1)``, ``nInterSteps = 2 (nNodes-1)``; tree latency
  ``2 ((P/nNodes - 1) intraLat + log2(nNodes) interLat)``, tree bus bandwidth x 0.9 and
  algorithm bandwidth half the bus bandwidth; the lowest ``latency + bytes / bandwidth``
  wins). Allgather is ring only (NCCL's tuner models only the ring for collectives other
  than allreduce).
- ``gloo`` (PyTorch's CPU backend, the network lab): ring for both. ``gloo::allreduce``
  maps ``UNSPECIFIED`` to ``ring`` (``gloo/allreduce.cc``); ``gloo::allgather`` is a ring.
- ``mpi`` (MPICH defaults, Thakur, Rabenseifner and Gropp, "Optimization of Collective
  Communication Operations in MPICH", IJHPCA 2005): allreduce up to 2 KiB by recursive
  doubling, larger by halving-doubling; allgather by recursive doubling when the gathered
  total is under 512 KiB and P is a power of two, else ring.

:func:`collective_time` prices a whole tensor's collective (allreduce, allgather,
reduce-scatter, all-to-all of ``X`` bytes in all) with the backend's schedule: the one
price the step-time model (:mod:`hexagram.cost.simulate`'s fits) and the planner
(:class:`hexagram.parallel.mesh.Mesh`) both charge; :func:`collective_parts` splits it
into its latency and byte terms (the planner pays a bucket's latency by byte share).

Example (2 hosts x 4 ranks, 100 GB/s inside, 10 GB/s between, 1 us / 10 us hops):
    >>> t = Topology(8, 4, 100e9, 1e-6, 10e9, 10e-6)
    >>> round(ring_allreduce(8e6, t) * 1e6, 1)   # 12 a + 2 e + 14e6 B / 10e9 B/s
    1432.0
    >>> choose("nccl", "allreduce", 8e6, t)[0], choose("nccl", "allreduce", 1e3, t)[0]
    ('ring', 'tree')
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hexagram.errors import ConfigError

__all__ = ["BACKENDS", "COLLECTIVES", "TREE_BW", "Topology", "alltoall", "choose",
           "collective_parts", "collective_time", "gtopk_tree", "halving_doubling_allreduce",
           "hierarchical_allreduce", "peer_exchange", "periodic",
           "recursive_doubling_allgather", "recursive_doubling_allreduce", "ring_allgather",
           "ring_allreduce", "ring_reduce_scatter", "tree_allreduce"]

#: NCCL's tree bus bandwidth is 0.9 of the link's (``busBw * .9`` in ``tuning.cc``).
TREE_BW = 0.9
BACKENDS = ("nccl", "gloo", "mpi")


@dataclass(frozen=True)
class Topology:
    """``world`` ranks, ``per_host`` on each host; rates in bytes/s, latencies in s;
    ``inter_bps`` is one host's uplink (links x rate / oversubscription)."""

    world: int
    per_host: int
    intra_bps: float
    intra_lat: float
    inter_bps: float
    inter_lat: float

    def __post_init__(self) -> None:
        if self.world < 1 or self.per_host < 1 or self.world % self.per_host:
            raise ConfigError(f"topology: world {self.world} must be a positive multiple of "
                              f"per_host {self.per_host}")
        if min(self.intra_bps, self.inter_bps) <= 0:
            raise ConfigError("topology: link rates must be > 0 bytes/s")

    @property
    def hosts(self) -> int:
        return self.world // self.per_host

    @property
    def ring_bps(self) -> float:
        """A ring's rate: one flow crosses each host boundary."""
        return self.intra_bps if self.hosts == 1 else min(self.intra_bps, self.inter_bps)

    def hop(self, distance: int) -> tuple[float, float]:
        """(latency, rate per rank) of a butterfly round between ranks ``distance`` apart
        (all ranks exchange at once, so a host's ``d`` flows share its uplink)."""
        if distance < self.per_host:
            return self.intra_lat, self.intra_bps
        return self.inter_lat, self.inter_bps / self.per_host


def _butterfly(t: Topology, sizes: list[tuple[int, float]]) -> float:
    """Seconds of rounds ``(distance, bytes sent)``, one after the other."""
    total = 0.0
    for distance, nbytes in sizes:
        lat, rate = t.hop(distance)
        total += lat + nbytes / rate
    return total


def _pow2(world: int) -> tuple[int, int]:
    """(largest power of two <= world, its log2)."""
    log = world.bit_length() - 1
    return 1 << log, log


def ring_allreduce(n: float, t: Topology) -> float:
    """Reduce-scatter then allgather around a ring of ``P`` ranks (``n`` bytes each)."""
    p, h = t.world, t.hosts
    if p == 1:
        return 0.0
    lat = 2 * (p - h) * t.intra_lat + 2 * (h - 1) * t.inter_lat
    return lat + 2 * (p - 1) / p * n / t.ring_bps


def tree_allreduce(n: float, t: Topology) -> float:
    """NCCL's double binary tree: a chain inside each host, a tree of depth
    ``ceil(log2 H)`` between hosts, reduce up then broadcast down (``2 n`` per rank)."""
    if t.world == 1:
        return 0.0
    depth = math.ceil(math.log2(t.hosts)) if t.hosts > 1 else 0
    lat = 2 * ((t.per_host - 1) * t.intra_lat + depth * t.inter_lat)
    return lat + 2 * n / (TREE_BW * t.ring_bps)


def _fold(n: float, t: Topology) -> float:
    """Two full-size hops folding the ranks beyond the largest power of two in and out."""
    p2, _ = _pow2(t.world)
    return 0.0 if p2 == t.world else 2 * _butterfly(t, [(p2, n)])


def recursive_doubling_allreduce(n: float, t: Topology) -> float:
    """``log2 P`` rounds; in round ``i`` ranks ``2^i`` apart swap and add all ``n`` bytes."""
    log = _pow2(t.world)[1]
    return _fold(n, t) + _butterfly(t, [(1 << i, n) for i in range(log)])


def halving_doubling_allreduce(n: float, t: Topology) -> float:
    """Rabenseifner: reduce-scatter by recursive halving (partners ``P/2, P/4, ...`` apart,
    half the remaining data each), then allgather by recursive doubling back."""
    p2, log = _pow2(t.world)
    halves = [(p2 >> (i + 1), n / (2 << i)) for i in range(log)]
    return _fold(n, t) + _butterfly(t, halves + halves[::-1])


def ring_allgather(m: float, t: Topology) -> float:
    """Each rank's ``m`` bytes go ``P-1`` hops around the ring."""
    p, h = t.world, t.hosts
    if p == 1:
        return 0.0
    return (p - h) * t.intra_lat + (h - 1) * t.inter_lat + (p - 1) * m / t.ring_bps


def ring_reduce_scatter(n: float, t: Topology) -> float:
    """The first half of a ring allreduce: each rank ends with ``n / P`` reduced bytes."""
    p, h = t.world, t.hosts
    if p == 1:
        return 0.0
    return (p - h) * t.intra_lat + (h - 1) * t.inter_lat + (p - 1) / p * n / t.ring_bps


def recursive_doubling_allgather(m: float, t: Topology) -> float:
    """``log2 P`` rounds; round ``i`` swaps the ``2^i m`` bytes gathered so far with the
    rank ``2^i`` away (non-powers of two: two more hops fold the rest in)."""
    p2, log = _pow2(t.world)
    extra = 0.0 if p2 == t.world else 2 * _butterfly(t, [(p2, (t.world - p2) * m)])
    return extra + _butterfly(t, [(1 << i, (1 << i) * m) for i in range(log)])


def alltoall(x: float, t: Topology) -> float:
    """Each rank sends ``(P-1)/P`` of ``x`` bytes, one chunk to every other rank, all at
    once: a host's ``d`` ranks push ``d (P-d)/P`` of their data through its uplink."""
    p, d = t.world, t.per_host
    if p == 1:
        return 0.0
    if t.hosts == 1:
        return t.intra_lat + x * (d - 1) / (p * t.intra_bps)
    return max(t.intra_lat, t.inter_lat) + x * d * (p - d) / (p * t.inter_bps)


def hierarchical_allreduce(n: float, t: Topology, backend: str = "nccl") -> float:
    """Reduce to each host's leader, allreduce among the ``H`` leaders (the ``backend``'s
    choice, one rank per host at the uplink rate), broadcast back: the leader receives
    and sends ``(d-1) n`` inside the host."""
    d = t.per_host
    inside = 2 * (t.intra_lat + (d - 1) * n / t.intra_bps) if d > 1 else 0.0
    leaders = Topology(t.hosts, 1, t.inter_bps, t.inter_lat, t.inter_bps, t.inter_lat)
    return inside + choose(backend, "allreduce", n, leaders)[1]


def gtopk_tree(pair_bytes: float, t: Topology) -> float:
    """gTop-k (:mod:`hexagram.comm.gtopk`): ``pair_bytes`` (``k`` pairs) a round. A power
    of two runs recursive doubling, ``log2 P`` swaps ``2^i`` apart; otherwise a binomial
    tree, ``ceil(log2 P)`` rounds up and as many down."""
    if t.world == 1:
        return 0.0
    p2, log = _pow2(t.world)
    if p2 == t.world:
        return _butterfly(t, [(1 << i, pair_bytes) for i in range(log)])
    up = [(1 << i, pair_bytes) for i in range(math.ceil(math.log2(t.world)))]
    return _butterfly(t, up + up[::-1])


def peer_exchange(sent: float, t: Topology) -> float:
    """Decentralized neighbours (``sent`` bytes to ring neighbours, sent concurrently):
    ranks are host-major, so one flow per host boundary; one hop of latency."""
    if t.world == 1:
        return 0.0
    lat = t.intra_lat if t.hosts == 1 else t.inter_lat
    return lat + sent / t.ring_bps


def periodic(exchange_s: float, period: int, hidden_s: float = 0.0) -> float:
    """Exposed seconds per step of an exchange every ``period`` steps (local SGD,
    DiLoCo), of which ``hidden_s`` per step overlaps with compute."""
    if period < 1:
        raise ConfigError(f"period must be >= 1 step, got {period}")
    return max(0.0, exchange_s / period - hidden_s)


_ALLREDUCE: dict[str, Callable[[float, Topology], float]] = {
    "ring": ring_allreduce, "tree": tree_allreduce,
    "recursive_doubling": recursive_doubling_allreduce,
    "halving_doubling": halving_doubling_allreduce}


def choose(backend: str, op: str, nbytes: float, t: Topology) -> tuple[str, float]:
    """(schedule, seconds) that ``backend`` runs for ``op`` (``allreduce`` of ``nbytes``
    per rank, or ``allgather`` of ``nbytes`` from each rank); see the module doc.

    Raises:
        ConfigError: unknown backend or op.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown collective backend {backend!r}; known: "
                          f"{', '.join(BACKENDS)}")
    if op == "allreduce":
        if backend == "gloo":
            names = ["ring"]
        elif backend == "nccl":
            names = ["ring", "tree"]
        else:
            names = ["recursive_doubling" if nbytes <= 2048 else "halving_doubling"]
        return min(((a, _ALLREDUCE[a](nbytes, t)) for a in names), key=lambda c: c[1])
    if op == "allgather":
        pow2 = _pow2(t.world)[0] == t.world
        if backend == "mpi" and pow2 and nbytes * t.world < 512 * 1024:
            return "recursive_doubling", recursive_doubling_allgather(nbytes, t)
        return "ring", ring_allgather(nbytes, t)
    raise ConfigError(f"choose: op must be 'allreduce' or 'allgather', got {op!r}")


#: whole-tensor collectives :func:`collective_time` prices
COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "all_to_all")


def _schedule(op: str, nbytes: float, t: Topology, backend: str
              ) -> Callable[[float], float]:
    """Seconds as a function of the tensor's bytes, on the schedule ``backend`` picks for a
    tensor of ``nbytes`` (the choice is made once, at the real size)."""
    p = t.world
    if op == "allreduce":
        name = choose(backend, "allreduce", nbytes, t)[0]
        return lambda n: _ALLREDUCE[name](n, t)
    if op == "allgather":
        name = choose(backend, "allgather", nbytes / p, t)[0]
        gather = ring_allgather if name == "ring" else recursive_doubling_allgather
        return lambda n: gather(n / p, t)
    if op == "reduce_scatter":  # a ring on every backend here (NCCL's only one)
        return lambda n: ring_reduce_scatter(n, t)
    if op == "all_to_all":
        return lambda n: alltoall(n, t)
    raise ConfigError(f"unknown collective {op!r}; known: {', '.join(COLLECTIVES)}")


def collective_parts(op: str, nbytes: float, t: Topology, backend: str = "gloo"
                     ) -> tuple[float, float]:
    """(latency seconds, byte seconds) of ``op`` on a tensor of ``nbytes`` in all (an
    allgather's output, a reduce-scatter's input) over ``t``, on ``backend``'s schedule.

    >>> t = Topology(4, 2, 100e9, 1e-6, 1e9, 1e-4)      # 2 hosts x 2 ranks
    >>> lat, body = collective_parts("allreduce", 4e6, t)
    >>> round(lat * 1e6, 1), round(body * 1e3, 3)      # 4 a + 2 e; 2 (P-1)/P X / 1 GB/s
    (204.0, 6.0)
    """
    if t.world == 1 or nbytes <= 0:
        return 0.0, 0.0
    fn = _schedule(op, nbytes, t, backend)
    latency = fn(0.0)
    return latency, fn(nbytes) - latency


def collective_time(op: str, nbytes: float, t: Topology, backend: str = "gloo",
                    count: float = 1.0) -> float:
    """Seconds of ``count`` collectives ``op`` of ``nbytes`` in all (:func:`collective_parts`):
    each pays the latency, the bytes are paid once (a fractional ``count``: a tensor's
    share of a bucket's one collective)."""
    latency, body = collective_parts(op, nbytes, t, backend)
    return count * latency + body
