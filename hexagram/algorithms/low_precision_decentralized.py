"""Low-precision decentralized SGD: compressed weight differences with ring neighbours.

BAGUA's D_LP_S algorithm, in the CHOCO-SGD form (Koloskova et al. 2019): each rank ``i``
keeps *public copies* ``h_j`` of its own weights and of its ring neighbours' weights, equal
on every rank that holds them. After each local optimizer step (every ``interval`` steps):

1. ``q_i = Q(x_i - h_i)``: compress the difference between my weights and my public copy;
2. send ``q_i`` to my neighbours, receive theirs;
3. ``h_j += decompress(q_j)`` for me and each neighbour ``j`` (replicas stay identical
   across ranks because everyone applies the same payloads);
4. ``x_i += gamma * sum_j w (h_j - h_i)`` with ``w = 1 / (neighbours + 1)``.

Only compressed differences cross the wire (8-bit min-max by default: about a quarter of
full precision). Without compression error and ``gamma = 1`` one round gives exactly
``x_i = mean(x_left, x_i, x_right)`` (at world size 2: ``mean(x_0, x_1)``), which the
tests check with the compressor's own reconstruction.

The round runs in ``after_step`` (after the first optimizer's ``step()``), so the averaged
weights are those used by the next forward pass.

One host read per round: the compressor's own NaN/Inf check (a read per bucket) is off;
instead a device flag of the payloads rides in the round's control collective (the join
counts), so a NaN/Inf weight on any rank stops every rank in the same round, before any
weight is mixed. So does a malformed payload received from a neighbour
(:meth:`~hexagram.compress.base.Compressor.payload_fault`, checked before it is decoded):
only its neighbours receive it, and its flag in the control collective reaches every rank,
which raises :class:`~hexagram.errors.MalformedPayloadError` naming the sender.

Example:
    >>> LowPrecisionDecentralizedConfig(compressor="fp16").gamma
    1.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hexagram.algorithms.base import AlgorithmContext
from hexagram.algorithms.finite import non_finite
from hexagram.algorithms.weight_sync import (
    RoundAlgorithm,
    as_compressor,
    check_compressor_spec,
    flats_from_named,
    named_from_flats,
    read_weights,
)
from hexagram.buckets import Bucket
from hexagram.comm import primitives
from hexagram.comm.peers import select_peers
from hexagram.compress.base import Compressor
from hexagram.config import check_float, check_int
from hexagram.errors import NonFiniteGradientError

__all__ = ["LowPrecisionDecentralizedAlgorithm", "LowPrecisionDecentralizedConfig"]


@dataclass(frozen=True, kw_only=True)
class LowPrecisionDecentralizedConfig:
    """Config of :class:`LowPrecisionDecentralizedAlgorithm`.

    Attributes:
        compressor: registry name (``hexagram.compress.names()``) or instance; fewer bits =>
            fewer bytes but slower consensus (more error to carry in the replicas).
        interval: communicate every ``interval`` optimizer steps; larger => less traffic,
            more drift between replicas.
        gamma: consensus step size in (0, 1]; smaller => more robust to coarse compressors,
            slower mixing.
    """

    compressor: str | Compressor = "minmax8"
    interval: int = 1
    gamma: float = 1.0

    def __post_init__(self) -> None:
        check_compressor_spec(self, "compressor", allow_none=False)
        check_int(self, "interval", low=1)
        check_float(self, "gamma", low=0.0, high=1.0, low_open=True)


class LowPrecisionDecentralizedAlgorithm(RoundAlgorithm):
    """Compressed ring gossip of weight differences; see the module docstring."""

    name = "low_precision_decentralized"
    checks_received = True

    def __init__(self, config: LowPrecisionDecentralizedConfig | None = None) -> None:
        super().__init__(config or LowPrecisionDecentralizedConfig())
        self.config: LowPrecisionDecentralizedConfig
        compressor = as_compressor(self.config.compressor)
        assert compressor is not None
        compressor.checks_finite = False  # the payloads' flag joins the round's one read
        self.compressor: Compressor = compressor
        # public copies: "self" and one per neighbour (group rank), one flat per bucket
        self.replicas: dict[str, list[Tensor]] = {}
        self._scratches: dict[int, Tensor] = {}  # per bucket index, reused every round

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        self.peers = select_peers("ring", ctx.comm.rank, ctx.comm.size)
        self._after_consensus()

    def _after_consensus(self) -> None:
        weights = read_weights(self.ctx.buckets)
        self.replicas = {key: [w.clone() for w in weights]
                         for key in ["self", *(str(p) for p in self.peers)]}

    def _on_step(self) -> None:
        if self.step % self.config.interval == 0 and self.peers:
            self._round(active=True)

    def _round(self, active: bool) -> int:
        """One CHOCO round, in place: each bucket's buffer holds the weights (x), the
        public copies take the payloads, one scratch buffer per bucket holds x - h_self
        and then each h_j - h_self (no temporaries as large as the model)."""
        comm, c = self.ctx.comm, self.compressor
        self.rounds += 1
        handles, flags = [], []
        for b, h_self in zip(self.ctx.buckets, self.replicas["self"]):
            b.copy_in_weights()
            payload = c.compress(torch.sub(b.flat, h_self, out=self._scratch(b)))
            flags += [non_finite(t.reshape(-1)) for t in payload.tensors
                      if t.is_floating_point()]
            c.decompress_into(payload, h_self, add=True)  # h_i += Q(x_i - h_i)
            handles.append(primitives.neighbor_exchange_payloads(comm, payload, self.peers,
                                                                 self.peers))
        bad = torch.stack(flags).any() if flags else False
        received = [handle.wait() for handle in handles]  # checked before any is decoded
        for payloads in received:
            for peer, payload in zip(self.peers, payloads):
                self._received(c.payload_fault(payload), peer)
        # the round's one host read: the join counts, how many ranks sent NaN/Inf, and
        # malformed payloads received (raised on every rank: no weight is mixed)
        counts = self._control(active, contributing=True, nonfinite=bad).wait()
        if counts.nonfinite:
            raise NonFiniteGradientError(
                f"low_precision_decentralized: the weights of {counts.nonfinite} rank(s) hold "
                f"NaN or Inf at round {self.rounds}; no weight was mixed. Lower the learning "
                "rate, clip gradients or use loss scaling")
        share = self.config.gamma / (len(self.peers) + 1)
        for i, (b, payloads) in enumerate(zip(self.ctx.buckets, received)):
            h_self, scratch = self.replicas["self"][i], self._scratch(b)
            for peer, payload in zip(self.peers, payloads):
                h_peer = self.replicas[str(peer)][i]
                c.decompress_into(payload, h_peer, add=True)  # as the neighbour did
                b.flat.add_(torch.sub(h_peer, h_self, out=scratch), alpha=share)
            b.copy_out_weights()
        self._sync_buffers()
        return int(counts.active)

    def _scratch(self, bucket: Bucket) -> Tensor:
        buf = self._scratches.get(bucket.index)
        if buf is None or buf.shape != bucket.flat.shape or buf.dtype != bucket.flat.dtype:
            buf = self._scratches[bucket.index] = torch.empty_like(bucket.flat)
        return buf

    def state_dict(self) -> dict[str, Any]:
        state = self._base_state()
        state["replicas"] = {k: named_from_flats(self.ctx.buckets, v)
                             for k, v in self.replicas.items()}
        state["compressor"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {"self", *(str(p) for p in self.peers)}
        if set(state["replicas"]) != expected:  # replicas are keyed by neighbour rank
            raise ValueError(f"low_precision_decentralized: checkpoint holds replicas of "
                             f"{sorted(state['replicas'])}, this rank's ring needs "
                             f"{sorted(expected)}; resume with the same world size and rank")
        self._load_base_state(state)
        self.replicas = {k: flats_from_named(self.ctx.buckets, v, f"replica {k}")
                         for k, v in state["replicas"].items()}
        self.compressor.load_state_dict(state["compressor"])
