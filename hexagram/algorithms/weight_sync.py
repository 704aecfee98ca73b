"""Shared pieces of the weight-based algorithms (decentralized, local SGD, DiLoCo, async).

- :class:`RoundAlgorithm`: a base for algorithms that communicate in *rounds* (every H
  steps, or every step). It counts optimizer steps, runs the *join* protocol that lets ranks
  with less data finish early, and implements :meth:`RoundAlgorithm.synchronize`.
- :func:`compressed_sum`: sum a tensor over ranks in full precision or with any compressor,
  choosing the collective from the compressor's ``aggregation`` (never guessed).
- :func:`average_weights` (the final average of ``synchronize()``) and
  :func:`sync_buffers` (BatchNorm statistics and other buffers: floating ones averaged,
  integer counters taken from rank 0, at every round and at ``synchronize()``), used by
  every weight algorithm.
- Small helpers to move bucket weights in and out and to save flat state by parameter name.

The join protocol (uneven data across ranks): every round starts with a tiny allreduce of
``[active, contributing]`` (:func:`hexagram.comm.control.count_flags`, the one control
collective, also behind ``DistributedDataParallel.join`` and the async algorithm's stop). A
rank that has run out of data calls ``model.synchronize()``, which keeps answering rounds
with ``active = 0`` (its weights still take part, so it neither blocks its peers nor loses
its last local steps) until a round in which no rank is active; every rank sees that same
count, leaves at the same round, and a final allreduce makes the weights identical. Rounds
therefore line up on every rank whatever the number of local steps, and no rank waits for a
peer that has finished.

Example:
    >>> from hexagram.algorithms.weight_sync import as_compressor
    >>> as_compressor(None) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from hexagram import compress
from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.buckets import Bucket, BucketEntry
from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.control import count_flags
from hexagram.comm.faults import _FIX, MALFORMED, FaultSink
from hexagram.comm.reduce import Encoder, reduce, reduce_many
from hexagram.compress.base import Compressor
from hexagram.errors import (
    NONFINITE_SUM,
    ConfigError,
    MalformedPayloadError,
    NonFiniteGradientError,
    step_error,
)

__all__ = [
    "RoundAlgorithm",
    "as_compressor",
    "average_weights",
    "check_compressor_spec",
    "compressed_sum",
    "flats_from_named",
    "named_from_flats",
    "read_weights",
    "require_optimizers",
    "sync_buffers",
    "write_weights",
]


def as_compressor(spec: str | Compressor | None) -> Compressor | None:
    """A compressor from a registry name (``hexagram.compress.names()``), an instance, or
    ``None`` (full precision).

    The weight algorithms keep the compressor's own NaN/Inf check (``checks_finite``):
    host reads once per exchange of weights, not per gradient bucket, and a NaN weight
    sent to a peer is worth stopping at once."""
    if spec is None or isinstance(spec, Compressor):
        return spec
    return compress.get(spec)


def check_compressor_spec(obj: Any, field: str, allow_none: bool) -> None:
    """Config check: ``obj.field`` is a compressor name, a Compressor, or (if allowed) None."""
    value = getattr(obj, field)
    ok = isinstance(value, (str, Compressor)) or (allow_none and value is None)
    if not ok:
        what = "a compressor name, a Compressor" + (" or None" if allow_none else "")
        raise ConfigError(f"{type(obj).__name__}.{field} must be {what} "
                          f"(see hexagram.compress.names()), got {value!r}")


def compressed_sum(comm: Communicator, tensor: Tensor, compressor: Compressor | None,
                   entries: Sequence[BucketEntry] = (), encode: Encoder | None = None,
                   faults: FaultSink | None = None) -> Handle[Tensor]:
    """Sum of ``tensor`` over the ranks of ``comm`` (a new tensor; input untouched).

    :func:`hexagram.comm.reduce.reduce_many` with ``reduction="sum"``: the collective follows
    the compressor's aggregation (full-precision allreduce for ``None``, compressed allreduce,
    scatter-gather, or allgather and a decode-and-sum into the output). With ``entries`` (a
    bucket's tensors; ``tensor`` is its flat buffer) each tensor is compressed on its own
    (layer-wise scales and top-k), all in one message per leg. ``encode``: the caller's
    encoder of tensor ``i`` (error feedback; see :mod:`hexagram.comm.reduce`). Every rank
    receives the same result bit for bit (same payloads, same order of summation).
    ``faults``: where the flags of malformed received payloads go
    (:mod:`hexagram.comm.faults`; e.g. :meth:`RoundAlgorithm._received_sink`), queued when
    the result is waited for.
    """
    flat = tensor.detach()
    if compressor is None or not entries:
        return reduce(comm, flat, compressor, reduction="sum", encode=encode, faults=faults)
    out = torch.empty_like(flat)
    parts = [slice(e.offset, e.offset + e.numel) for e in entries]
    return reduce_many(comm, [flat[p] for p in parts], compressor, reduction="sum",
                       outs=[out[p] for p in parts], encode=encode,
                       faults=faults).then(lambda _: out)


def require_optimizers(ctx: AlgorithmContext, name: str) -> torch.optim.Optimizer:
    """The first optimizer given to the wrapper (its steps are counted); clear error if none."""
    if not ctx.optimizers:
        raise ConfigError(
            f"algorithm {name!r} communicates after optimizer steps: pass the optimizer(s) "
            "to hexagram.DistributedDataParallel(model, optimizers=[opt], ...)")
    return ctx.optimizers[0]


def read_weights(buckets: Sequence[Bucket]) -> list[Tensor]:
    """A copy of the current weights, one flat tensor per bucket."""
    out = []
    for b in buckets:
        b.copy_in_weights()
        out.append(b.flat.clone())
    return out


def write_weights(buckets: Sequence[Bucket], flats: Sequence[Tensor]) -> None:
    """Write one flat tensor per bucket into the parameters."""
    for b, flat in zip(buckets, flats):
        b.copy_out_weights(flat)


def average_weights(comm: Communicator, buckets: Sequence[Bucket]) -> None:
    """Replace the weights of ``buckets`` by their mean over the ranks (collective).

    The mean is checked before it is written (one host read: this runs once, at the end):
    NaN/Inf in it means some rank's weights held them, and every rank holds the same
    mean, so every rank raises the same :class:`~hexagram.errors.NonFiniteGradientError`
    (no sender can be named from a sum) and keeps its own weights rather than write the
    poisoned mean into the model.
    """
    if comm.size == 1:
        return
    flats = read_weights(buckets)
    handles = [primitives.allreduce(comm, flat, average=True) for flat in flats]
    means = [h.wait() for h in handles]
    if means and not bool(torch.stack([m.isfinite().all() for m in means]).all()):
        raise NonFiniteGradientError(
            f"{NONFINITE_SUM} in the final average of the weights (synchronize()): a rank's "
            "weights hold NaN/Inf, so their mean does on every rank; the model keeps this "
            "rank's weights. Find the diverging rank (lower the learning rate, or train "
            "with algorithm='robust' against a faulty peer)")
    write_weights(buckets, means)


def sync_buffers(comm: Communicator, module: torch.nn.Module) -> None:
    """Make ``module``'s buffers equal on every rank (collective).

    Floating buffers (BatchNorm running mean and variance) are averaged, one allreduce per
    dtype and device; integer buffers (``num_batches_tracked``) are taken from rank 0, as
    PyTorch DDP's ``broadcast_buffers`` does for all buffers. Buffers are few and small.
    """
    if comm.size == 1:
        return
    floats: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    others = []
    for b in module.buffers():
        if b.is_floating_point() or b.is_complex():
            floats.setdefault((b.dtype, b.device), []).append(b)
        else:
            others.append(b)
    handles = [(group, primitives.allreduce(
        comm, torch.cat([b.detach().reshape(-1) for b in group]), average=True))
        for group in floats.values()]
    done = primitives.broadcast(comm, others, src=0)
    with torch.no_grad():
        for group, handle in handles:
            flat, offset = handle.wait(), 0
            for b in group:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
    done.wait()


def named_from_flats(buckets: Sequence[Bucket], flats: Sequence[Tensor]) -> dict[str, Tensor]:
    """Flat per-bucket state -> ``{parameter name: tensor}`` (what checkpoints hold)."""
    return {e.name: b.view(e, flat).clone() for b, flat in zip(buckets, flats)
            for e in b.entries}


def flats_from_named(buckets: Sequence[Bucket], named: dict[str, Tensor], what: str
                     ) -> list[Tensor]:
    """Inverse of :func:`named_from_flats`; names a missing parameter clearly."""
    out = []
    for b in buckets:
        flat = torch.empty_like(b.flat)
        for e in b.entries:
            if e.name not in named:
                raise KeyError(f"{what}: checkpoint has no entry for parameter {e.name!r}; "
                               "was it saved from the same model and algorithm?")
            b.view(e, flat).copy_(named[e.name])
        out.append(flat)
    return out


#: a queued fault: 0-d flag, sender (-1: unknown), explanation (None: named by counts)
_Fault = tuple[Tensor, int, "Callable[[], str] | None"]


class RoundAlgorithm(Algorithm):
    """Base of weight algorithms that communicate in collective rounds (see module doc).

    Subclasses implement :meth:`_round` (one collective round) and may override
    :meth:`_finish_pending` and :meth:`_after_consensus`. ``self.step`` counts steps that
    every optimizer took; ``self.rounds`` counts rounds (identical on every rank);
    ``self.dirty`` is True when local steps were taken since the last round.
    """

    kind = "weight"

    #: True where a round decodes payloads received from peers: their malformed flags
    #: (:meth:`_received`) ride in the next control collective, which raises
    #: :class:`~hexagram.errors.MalformedPayloadError` on every rank at once
    checks_received: ClassVar[bool] = False

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.step = 0
        self.rounds = 0
        self.dirty = False
        # (flag, sender, explanation) queued, and those in the control in flight
        self._faults: list[_Fault] = []
        self._checking: list[_Fault] = []

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        self._optimizer = require_optimizers(ctx, self.name)
        self._counts = {id(o): self.step for o in ctx.optimizers}

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A step is counted once every optimizer has stepped (Muon for the matrices and
        AdamW for the rest, stepped one after the other: the round follows the last one,
        so no parameter moves between the round and the next forward pass)."""
        if id(optimizer) not in self._counts:
            return
        self._counts[id(optimizer)] += 1
        if min(self._counts.values()) > self.step:
            self.step += 1
            self.dirty = True
            self._on_step()

    def _on_step(self) -> None:
        """Called after each counted step (start a round here if it is due)."""

    def _control(self, active: bool, contributing: bool,
                 nonfinite: Tensor | bool | None = None) -> Handle[Any]:
        """Start the join allreduce; result ``(active, contributing)``: how many ranks are
        still training, how many have local steps to contribute.

        With ``nonfinite`` (a 0-dim bool tensor on any device, computed by the caller on
        the device: e.g. its encoded update holds NaN/Inf; or a bool where the rank has
        nothing to check) the result has a third count,
        ``nonfinite``: how many ranks raised it. It rides in the same allreduce, so the
        round's one host read (the counts) is also its finiteness check, and every rank
        learns of a bad peer at the same round. Every rank of a round passes it or none.
        """
        flags: dict[str, Any] = {"active": active, "contributing": contributing}
        if nonfinite is not None:
            flags["nonfinite"] = nonfinite
        if not self.checks_received:
            return count_flags(self.ctx.comm, **flags)
        flags["malformed"], flags["culprit"] = self._fault_flags()
        return count_flags(self.ctx.comm, **flags).then(self._raise_malformed)

    def _received(self, flag: Tensor, sender: int,
                  explain: Callable[[], str] | None = None) -> None:
        """Queue the 0-d flag of something received from ``sender`` (-1: unknowable, a
        sum) that cannot be used (a malformed payload, NaN/Inf weights), no host read: it
        rides in the next control collective (:attr:`checks_received`). ``explain`` (read
        only on a failure) words it where every rank receives the same bytes (a sum, a
        gather): then every rank raises its words; else the rank is named from the
        control's counts."""
        self._faults.append((flag.reshape(()), sender, explain))

    def _received_sink(self) -> Callable[[Tensor, Callable[[], str]], None]:
        """A fault sink (:mod:`hexagram.comm.faults`) for a round's collectives: queues the
        flag, sender unnamed. The collective's explanation would name the sender of a
        gathered payload, but it holds the payloads received (up to a compressed copy of
        the model per leg), which would then stay alive through the inner steps until the
        next round's control: memory a round algorithm does not spend on a name."""
        return lambda flag, _explain: self._received(flag, -1)

    def _fault_flags(self) -> tuple[Tensor | bool, Tensor | int]:
        """(something received since the last control is unusable, the first such
        sender's rank + 1, 0 if none or unknowable), on the device; empties the queue."""
        faults, self._faults = self._faults, []
        self._checking = faults
        if not faults:
            return False, 0
        bad = torch.stack([f for f, _, _ in faults])
        # the largest flagged sender (scalars: no tensor made from host data)
        senders = torch.stack([torch.where(f, r + 1, 0) for f, r, _ in faults])
        return bad.any(), senders.amax()

    def _raise_malformed(self, counts: Any) -> Any:
        """The control's counts, unless a rank received something unusable: then
        :class:`~hexagram.errors.MalformedPayloadError` (or, for NaN/Inf in a sum,
        :class:`~hexagram.errors.NonFiniteGradientError`) on every rank, with the same
        message everywhere: the explanation every rank queued, where every rank reported,
        else the sender named by the counts where the ranks agree. Where a rank found
        NaN/Inf in what it sent (``counts.nonfinite``), the counts are returned: the caller
        raises that."""
        checking, self._checking = self._checking, []
        sent_nonfinite: int = getattr(counts, "nonfinite", 0)
        if not counts.malformed or sent_nonfinite:
            # a sender that found NaN/Inf in what it sent says so itself (the caller
            # raises on ``nonfinite``): more precise than its receivers' view of it
            return counts
        # the first flag queued that holds (reads the device: only on the failure)
        explain = next((e for f, _, e in checking if bool(f)), None)
        if explain is not None and counts.malformed == self.ctx.comm.size:
            # every rank received the same (a sum, a gather): the same words everywhere
            raise step_error(f"{explain()} (found before round {self.rounds} by {self.name})")
        sender, agreed = divmod(counts.culprit, counts.malformed)
        who = f"rank {sender - 1}" if not agreed and sender > 0 else "a rank"
        raise MalformedPayloadError(
            f"{MALFORMED}: {self.name}: {who} sent a malformed payload before round "
            f"{self.rounds} (indices out of range or repeated, or values NaN/Inf; reported "
            f"by {counts.malformed} rank(s), which received it); {_FIX}")

    def _sync_buffers(self) -> None:
        """End of a round: buffers (BatchNorm statistics) equal on every rank."""
        sync_buffers(self.ctx.comm, self.ctx.module)

    def _round(self, active: bool) -> int:
        """One collective round; returns how many ranks were active in it."""
        raise NotImplementedError

    def _finish_pending(self) -> None:
        """Complete communication started earlier (e.g. in ``before_forward``)."""

    def _after_consensus(self) -> None:
        """Reset state that refers to the weights after :meth:`synchronize` equalised them."""

    def synchronize(self) -> None:
        """Answer rounds until no rank is active, then average weights over all ranks (and
        buffers: see :func:`sync_buffers`).

        Collective: every rank calls it once it has no more data (ranks may arrive after
        different numbers of steps). Afterwards every rank holds the same weights.

        Raises:
            NonFiniteGradientError: the last round received NaN/Inf or a malformed payload
                (:attr:`checks_received`), or the final mean holds NaN/Inf
                (:func:`average_weights`): the same error on every rank.
        """
        self._finish_pending()
        if self.ctx.comm.size > 1:
            while self._round(active=False) > 0:
                pass
            if self.checks_received:  # what the last round received, checked on every
                self._control(False, False).wait()  # rank (it raises), before the mean
            average_weights(self.ctx.comm, self.ctx.buckets)
            self._sync_buffers()
        self.dirty = False
        self._after_consensus()

    def _base_state(self) -> dict[str, Any]:
        return {"step": self.step, "rounds": self.rounds, "dirty": self.dirty}

    def _load_base_state(self, state: dict[str, Any]) -> None:
        self.step, self.rounds = int(state["step"]), int(state["rounds"])
        self.dirty = bool(state["dirty"])
        self._counts = {k: self.step for k in getattr(self, "_counts", {})}
