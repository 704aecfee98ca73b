"""Predicted step time of an algorithm from measured compute, compressor and network costs.

A gradient algorithm's step (``predict``), per bucket in launch order:

- the bucket is ready when its last gradient is (:class:`ComputeProfile` ready times),
  later by the compression already done on the training thread (compressing a bucket
  happens inside backward's hook, so it delays everything after it);
- its messages (:func:`hexagram.cost.schedule.bucket_schedule`) start when it is ready and
  the previous bucket's communication is over (one issuing thread, one link), each taking
  ``rounds * latency + sent / rate`` of its collective's fit
  (:class:`hexagram.cost.probe.NetworkProfile`); the last bucket's are followed by the
  algorithm's once-per-step messages (:func:`hexagram.cost.schedule.step_end_messages`);
- decoding (once per payload received for gathered formats) follows its messages;
- the update starts when backward and the last bucket are both done.

``chain = forward + max(backward end, last bucket done) + update``.

Where ranks share cores (:attr:`NetworkProfile.share` > 1: emulated hosts on one box, or
more ranks than cores), the ranks of a synchronous algorithm run in lockstep: they compute
at the same moments, so the compute is taken as ``share`` times its CPU seconds
(:func:`lockstep`; the wall time measured alone depends on how the ranks happened to
overlap). Compression costs are CPU seconds (:func:`hexagram.cost.profile.device_clock`),
scaled by ``share`` the same way; the network fits are measured on all ranks at once, so
they carry the sharing already. The step also cannot be shorter than the CPU the ranks
need in all: ``floor = share * (compute CPU + messages' CPU from the probe's CPU fits +
compression CPU)`` (:func:`cpu_floor`), so ``step = max(chain, floor)``. With ``share <= 1``
or no CPU figures, ``step = chain``.

The parts reported are
compute (forward + backward + update, measured), compression CPU (encode + decode) and the
exposed communication (what is left). Weight algorithms (local SGD, DiLoCo, decentralized,
async) are amortized per step (:func:`amortized`).

Example (hand-checkable: one 1 MB bucket ready at 10 ms, a 1 ms + 10 MB/s allreduce)::

    >>> from hexagram.cost.probe import Fit, NetworkProfile
    >>> import hexagram as hx
    >>> net = NetworkProfile(2, 2, {k: Fit(0.001, 1e7) for k in
    ...                             ("allreduce", "allgather", "alltoall", "p2p")})
    >>> comp = ComputeProfile(0.005, 0.010, 0.002, [TensorSpec("w", (250_000,))], [0.010])
    >>> p = predict(hx.algorithms.get("allreduce"), comp, net)
    >>> round(p.step_s, 4)      # 5 ms + 10 ms + (1 ms + 1e6 B / 1e7 B/s) + 2 ms
    0.118
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hexagram.compress.base import Aggregation
from hexagram.cost.facts import Priced, compressor_of
from hexagram.cost.probe import NetworkProfile
from hexagram.cost.profile import CompressorCost, ComputeProfile
from hexagram.cost.schedule import (
    Message,
    TensorSpec,
    bucket_schedule,
    payload_of,
    step_end_messages,
)

__all__ = ["MB", "Prediction", "amortized", "bucket_layout", "cpu_floor", "gathered_decodes",
           "lockstep", "predict", "predict_any"]

MB = 1024 * 1024


@dataclass
class Prediction:
    """Predicted step of one algorithm configuration (seconds, bytes)."""

    label: str
    step_s: float
    compute_s: float
    compress_s: float
    exposed_s: float
    wire_bytes: int
    bucket_bytes: int
    schedule: list[list[Message]] = field(default_factory=list)
    note: str = ""
    cpu_floor_s: float = 0.0  # share * CPU per rank (0: cores not shared, or unmeasured)

    def describe_schedule(self) -> str:
        """``"3 buckets: allreduce 12.0 MB, ..."``: the messages assumed, summed by kind."""
        kinds: dict[str, int] = {}
        for msgs in self.schedule:
            for m in msgs:
                kinds[m.op] = kinds.get(m.op, 0) + m.sent
        body = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in kinds.items())
        return f"{len(self.schedule)} bucket(s): {body or 'no messages'}"


def bucket_layout(profile: ComputeProfile, bucket_bytes: int, first_bucket_bytes: int
                  ) -> list[tuple[list[TensorSpec], float]]:
    """The engine's bucketing rule (``hexagram.buckets.build_buckets``: close a bucket once
    it holds its cap; first bucket capped at ``first_bucket_bytes``) over the ready order,
    with each bucket's ready time (its last gradient's)."""
    out: list[tuple[list[TensorSpec], float]] = []
    current: list[TensorSpec] = []
    size, ready = 0, 0.0
    first_cap = min(first_bucket_bytes, bucket_bytes)
    for spec, t in zip(profile.tensors, profile.ready_s):
        current.append(spec)
        size += spec.numel * spec.itemsize
        ready = max(ready, t)
        if size >= (first_cap if not out else bucket_bytes):
            out.append((current, ready))
            current, size, ready = [], 0, 0.0
    if current:
        out.append((current, ready))
    return out


def _cpu(algorithm: Priced, specs: Sequence[TensorSpec], world: int,
         cost: CompressorCost | None, msgs: Sequence[Message] = ()) -> tuple[float, float]:
    """(encode, decode) seconds of one bucket whose messages are ``msgs``: ``encode`` on
    the training thread, every segment compressed once; ``decode`` on the communication
    thread, once per rank's payload for gathered formats. gTop-k: its measured tree work
    where ``cost.tree`` has it (sort, ``ceil(log2 P)`` merge rounds, the result written:
    :mod:`hexagram.cost.own_work`), else one decode per merge (:func:`gathered_decodes`).
    Scatter-gather (an all-to-all among ``msgs``;
    :func:`hexagram.comm.primitives.scatter_gather_many`) compresses each of a segment's P
    chunks on its own, then decodes the P chunks received, compresses the reduced one and
    decodes the P gathered ones: P encodes, then 2P decodes and an encode, of ``n / P``
    elements each (every call pays the intercept). QAdam compresses whole buckets; its
    momentum arithmetic (``cost.tree``, :func:`hexagram.cost.own_work.qadam_own_cost`)
    adds ``once(n)`` to the encode and ``per_round(n)`` to the decode."""
    comp = compressor_of(algorithm)
    if comp is None or cost is None or world <= 1:
        return 0.0, 0.0
    sizes = [s.numel for s in specs]
    if algorithm.granularity == "bucket":
        sizes = [sum(sizes)]
    if comp.aggregation is Aggregation.SCATTER_GATHER and any(m.op == "alltoall"
                                                              for m in msgs):
        chunks = [-(-n // world) for n in sizes]
        enc = sum(world * cost.encode(c) for c in chunks)
        return enc, sum(2 * world * cost.decode(c) + cost.encode(c) for c in chunks)
    enc = sum(cost.encode(n) for n in sizes)
    if algorithm.own_work == "tree" and cost.tree is not None:
        rounds = max(1, math.ceil(math.log2(world)))
        dec = sum(cost.tree.seconds(n, rounds) for n in sizes)
    elif comp.aggregation in (Aggregation.GATHER, Aggregation.SCATTER_GATHER):
        dec = sum(gathered_decodes(algorithm, world) * cost.decode(n) for n in sizes)
    else:
        dec = sum(cost.decode(n) for n in sizes)
    if algorithm.own_work == "momentum" and cost.tree is not None:  # e.g. QAdam's
        enc += sum(cost.tree.once[0] + cost.tree.once[1] * n for n in sizes)
        dec += sum(cost.tree.per_round[0] + cost.tree.per_round[1] * n for n in sizes)
    return enc, dec


def gathered_decodes(algorithm: Priced, world: int) -> int:
    """Payloads a rank decodes per segment of a gathered format: all ``world`` of an
    allgather; gTop-k merges one per round of its tree (``ceil(log2 P)``, recursive
    doubling or binomial tree, :mod:`hexagram.comm.gtopk`) and decodes the result once.

    >>> import hexagram as hx
    >>> g, t = hx.algorithms.get("gtopk"), hx.algorithms.get("topk")
    >>> gathered_decodes(g, 4096), gathered_decodes(t, 64)
    (13, 64)
    """
    return algorithm.gathered_decodes(world)


def predict(algorithm: Priced, compute: ComputeProfile, network: NetworkProfile,
            cost: CompressorCost | None = None, *, bucket_bytes: int = 25 * MB,
            first_bucket_bytes: int = MB, label: str | None = None, step: int = 10**9,
            rank: int = 0) -> Prediction:
    """Predicted step of a gradient algorithm (see the module doc); ``cost`` is its
    compressor's measured cost (None: no compression CPU counted)."""
    world, free, shift, enc_total, dec_total = network.world, 0.0, 0.0, 0.0, 0.0
    schedule: list[list[Message]] = []
    compute, k = lockstep(compute, network), max(1.0, network.share)
    layout = list(bucket_layout(compute, bucket_bytes, first_bucket_bytes))
    for i, (specs, ready) in enumerate(layout):
        msgs = bucket_schedule(algorithm, specs, world, step, network.hosts, rank)
        if i == len(layout) - 1:  # then the algorithm's once-per-step messages
            msgs = [*msgs, *step_end_messages(algorithm, world, step, rank)]
        enc, dec = _cpu(algorithm, specs, world, cost, msgs) if msgs else (0.0, 0.0)
        enc, dec = k * enc, k * dec  # CPU seconds, in lockstep with the other ranks
        shift += enc
        start = max(ready + shift, free)
        wire = sum(_message_time(network, m) for m in msgs)
        free = start + wire + dec
        enc_total, dec_total = enc_total + enc, dec_total + dec
        schedule.append(msgs)
    end = max(compute.backward_s + shift, free)
    chain = compute.forward_s + end + compute.update_s
    compress = enc_total + dec_total
    floor = cpu_floor(compute, network, compress, schedule)
    step_s = max(chain, floor)
    return Prediction(label or algorithm.name, step_s, compute.step_s, compress,
                      max(0.0, step_s - compute.step_s - compress),
                      sum(m.sent for msgs in schedule for m in msgs), bucket_bytes, schedule,
                      cpu_floor_s=floor)


def lockstep(compute: ComputeProfile, network: NetworkProfile) -> ComputeProfile:
    """``compute`` with its times scaled so the step's compute lasts ``share`` times its
    CPU seconds, where ranks share cores and the CPU is known (else ``compute`` itself);
    never faster than measured (other jobs may slow it more).

    >>> from hexagram.cost.probe import NetworkProfile
    >>> c = ComputeProfile(0.01, 0.02, 0.01, [], [], cpu_s=0.04)
    >>> lockstep(c, NetworkProfile(4, 4, {}, share=2.0)).step_s
    0.08
    """
    if network.share <= 1.0 or compute.cpu_s is None or compute.step_s <= 0:
        return compute
    k = max(1.0, network.share * compute.cpu_s / compute.step_s)
    return ComputeProfile(compute.forward_s * k, compute.backward_s * k, compute.update_s * k,
                          compute.tensors, [t * k for t in compute.ready_s], compute.cpu_s)


def cpu_floor(compute: ComputeProfile, network: NetworkProfile, compress_s: float,
              schedule: Sequence[Sequence[Message]]) -> float:
    """``share * (compute CPU + messages' CPU) + compression`` seconds where ranks share
    cores (``network.share > 1``), else 0 (see the module doc); ``compress_s`` is already
    scaled by ``share``, as :func:`predict` passes it.

    >>> from hexagram.cost.probe import Fit, NetworkProfile
    >>> net = NetworkProfile(4, 4, {}, cpu={"allreduce": Fit(0.001, 1e8)}, share=2.0)
    >>> comp = ComputeProfile(0.0, 0.1, 0.0, [], [], cpu_s=0.05)
    >>> round(cpu_floor(comp, net, 0.01, [[Message("allreduce", 10**6)]]), 4)
    0.132
    """
    if network.share <= 1.0 or compute.cpu_s is None or not network.cpu:
        return 0.0
    comm = 0.0
    for msgs in schedule:
        for m in msgs:
            fit = network.cpu_fit(m.op)
            comm += fit.time(m.sent, m.rounds) if fit is not None else 0.0
    return network.share * (compute.cpu_s + comm) + compress_s


def _message_time(network: NetworkProfile, m: Message) -> float:
    if m.op == "hierarchical" and network.intra is not None:
        return network.intra.time(m.sent) + network.fit("allreduce").time(m.sent)
    return network.fit(m.op).time(m.sent, m.rounds)


def _ring(nbytes: int, world: int) -> int:
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


def amortized(algorithm: Priced, compute: ComputeProfile, network: NetworkProfile,
              label: str | None = None) -> Prediction:
    """A weight algorithm's step, its periodic exchange spread over its period.

    local SGD / DiLoCo / SparseLoCo: the messages of their ``round_messages`` (the
    exchange's route: an allreduce in full precision, all-to-all + allgather for 8- and
    4-bit, an allgather for SparseLoCo's sparse payloads) every ``period`` steps, after the
    optimizer (``overlap_steps`` > 0 hides them behind the next steps);
    decentralized: the weights to its peers (an allreduce for ``peers="all"``) every
    ``interval`` steps, overlapped with the forward pass; low-precision decentralized:
    compressed weights to both ring neighbours every step; async: a background thread,
    nothing exposed (its bytes depend on wall time, not steps: reported as one average
    per step, an estimate).
    """
    c, world = algorithm.config, network.world
    weights = sum(t.numel * t.itemsize for t in compute.tensors)
    period = max(1, int(getattr(c, "period", getattr(c, "interval", 1))))
    name, hidden, note = algorithm.name, 0.0, ""
    msgs = [Message("allreduce", _ring(weights, world))]
    comp = compressor_of(algorithm)
    peers = getattr(c, "peers", "all")
    own = getattr(algorithm, "round_messages", None)  # the DiLoCo family's exchange
    if callable(own):
        msgs = [Message(op, sent) for op, sent in own([t.shape for t in compute.tensors],
                                                       world)]
    elif comp is not None:  # compressed weights (differences) to both ring neighbours
        msgs = [Message("p2p", min(2, world - 1) * sum(
            payload_of(comp, t.shape).nbytes for t in compute.tensors))]
    elif peers != "all":
        msgs = [Message("p2p", (2 if peers == "ring" else 1) * weights)]
    t = sum(network.fit(m.op).time(m.sent) for m in msgs) / period if world > 1 else 0.0
    if algorithm.exchange_overlap == "forward":
        hidden = compute.forward_s
    if algorithm.exchange_overlap == "background" or getattr(c, "overlap_steps", 0) > 0:
        hidden, note = t, "background exchange: bytes per step estimated"
    exposed = max(0.0, t - hidden)
    return Prediction(label or name, compute.step_s + exposed, compute.step_s, 0.0, exposed,
                      sum(m.sent for m in msgs) // period if world > 1 else 0, 0,
                      [msgs] if world > 1 else [], note)


def predict_any(algorithm: Priced, compute: ComputeProfile, network: NetworkProfile,
                costs: Mapping[str, CompressorCost] | None = None, **kw: Any) -> Prediction:
    """:func:`predict` for gradient algorithms, :func:`amortized` for weight ones;
    ``costs`` maps a label (``kw["label"]`` or the name) to its compressor cost."""
    label = kw.get("label") or algorithm.name
    if algorithm.kind == "weight":
        return amortized(algorithm, compute, network, label)
    return predict(algorithm, compute, network, (costs or {}).get(label), **kw)
