"""Decentralized SGD: full-precision weight exchange with a few peers (BAGUA's D_FP_S).

Each communication step, rank ``i`` replaces its weights by the uniform mean of its own and
its peers' weights, then applies its local gradient (D-PSGD, Lian et al. 2017):
``x_i <- mean(x_j for j in {i} + peers(i)) - lr * grad_i(x_i)``.

When the averaged weights land (what the tests check): the exchange starts in
``before_forward`` from the weights at the start of the step, so it overlaps the forward and
backward passes; it is finished in a pre-hook of the first optimizer's ``step()``, which
writes the mean into the parameters just before the optimizer applies the gradient (computed
at the pre-average weights). Only training forwards start an exchange (``module.training``
and gradients enabled), so evaluation passes do not communicate.

Peers (``hexagram.comm.peers``): ``all`` (an allreduce), ``ring`` (left and right; one
neighbour at world size 2), ``shift_one`` (one partner per round, round-robin tournament) and
``random`` (a random perfect matching). With odd world sizes ``shift_one``/``random`` leave
one rank out per round; it keeps its weights. Every round also carries the join flags (see
:mod:`hexagram.algorithms.weight_sync`), so ranks with less data can stop early.

What arrives is checked on the device, with no host read: weights received holding NaN or
Inf (a neighbour's, naming it; or the allreduced mean, whose sender cannot be known) are not
mixed in (the rank keeps its own weights that round), and their flag rides in the next
round's control collective, which raises on every rank
(:class:`~hexagram.errors.MalformedPayloadError` naming the neighbour, or
:class:`~hexagram.errors.NonFiniteGradientError` for a mean).

Example:
    >>> cfg = DecentralizedConfig(peers="ring", interval=2)
    >>> DecentralizedAlgorithm(cfg).config.peers
    'ring'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hexagram.algorithms.base import AlgorithmContext
from hexagram.algorithms.finite import non_finite
from hexagram.algorithms.weight_sync import RoundAlgorithm, read_weights, write_weights
from hexagram.comm import primitives
from hexagram.comm.communicator import Handle
from hexagram.comm.peers import PEER_SELECTIONS, select_peers
from hexagram.config import check_choice, check_int

__all__ = ["DecentralizedAlgorithm", "DecentralizedConfig"]


@dataclass(frozen=True, kw_only=True)
class DecentralizedConfig:
    """Config of :class:`DecentralizedAlgorithm`.

    Attributes:
        peers: ``"all"``, ``"ring"``, ``"shift_one"`` or ``"random"``; more peers => faster
            consensus but more bytes and more latency per exchange.
        interval: exchange every ``interval`` optimizer steps; larger => less traffic, but
            replicas drift further apart between exchanges.
        seed: seed of the ``"random"`` matchings (must be equal on every rank).
    """

    peers: str = "all"
    interval: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice(self, "peers", PEER_SELECTIONS)
        check_int(self, "interval", low=1)
        check_int(self, "seed", low=0)


@dataclass
class _Exchange:
    """A round in flight: own weights (one flat per bucket), their handles, join flags,
    the peers whose weights arrive."""

    own: list[Tensor]
    handles: list[Handle[Any]]
    control: Handle[Any]
    npeers: int
    peers: list[int]


def _summed_nonfinite() -> str:
    return ("decentralized: the average over the ranks of the weights holds NaN or Inf (a "
            "rank sent NaN/Inf weights; the sender cannot be known from a sum); it was not "
            "mixed in, each rank kept its own weights. Lower the learning rate, clip "
            "gradients or use loss scaling; if one rank is faulty or hostile, check its host "
            "and network")


class DecentralizedAlgorithm(RoundAlgorithm):
    """Weight exchange with peers every ``interval`` steps; see :class:`DecentralizedConfig`."""

    name = "decentralized"
    exchange_overlap = "forward"  # the exchange starts before the forward pass
    checks_received = True  # neighbours' weights: NaN/Inf flagged, raised next round

    def __init__(self, config: DecentralizedConfig | None = None) -> None:
        super().__init__(config or DecentralizedConfig())
        self.config: DecentralizedConfig
        self._pending: _Exchange | None = None

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        self._hook = self._optimizer.register_step_pre_hook(self._before_step)

    def before_forward(self) -> None:
        module = self.ctx.module
        training = module.training and torch.is_grad_enabled()
        due = self.step % self.config.interval == 0
        if self._pending is None and training and due and self.ctx.comm.size > 1:
            self._pending = self._start(active=True)

    def _before_step(self, *_: Any) -> None:
        if self._pending is not None:  # the round started in before_forward ends here
            self._finish_pending()
            self._sync_buffers()  # after the forward pass updated the statistics

    def _start(self, active: bool) -> _Exchange:
        comm = self.ctx.comm
        peers = select_peers(self.config.peers, comm.rank, comm.size, step=self.rounds,
                             seed=self.config.seed)
        self.rounds += 1
        control = self._control(active, contributing=True)
        own = read_weights(self.ctx.buckets)
        handles: list[Handle[Any]]
        if self.config.peers == "all":
            handles = [primitives.allreduce(comm, w.clone(), average=True) for w in own]
        else:
            handles = [primitives.neighbor_exchange(comm, w, peers, peers) for w in own]
        return _Exchange(own, handles, control, len(peers), list(peers))

    def _finish(self, ex: _Exchange) -> int:
        mixed = []
        for own, handle in zip(ex.own, ex.handles):
            got = handle.wait()
            if self.config.peers == "all":
                bad = non_finite(got)
                self._received(bad, -1, _summed_nonfinite)
                mixed.append(torch.where(bad, own, got))
            else:  # uniform weights 1/(k+1) over me and my k peers (k = 0: unchanged)
                flags = [non_finite(w) for w in got]
                for peer, flag in zip(ex.peers, flags):
                    self._received(flag, peer)
                mix = torch.stack([own, *got]).sum(0) / (ex.npeers + 1)
                mixed.append(torch.where(torch.stack(flags).any(), own, mix) if flags
                             else mix)
        write_weights(self.ctx.buckets, mixed)
        # host read (kept, weight algorithm: once per exchange, not per bucket): the count of
        # active ranks the engine's join and elastic checks need on the host
        return int(ex.control.wait().active)

    def _finish_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._finish(pending)

    def _round(self, active: bool) -> int:
        n_active = self._finish(self._start(active))
        self._sync_buffers()
        return n_active

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:
            raise RuntimeError("decentralized: state_dict() during a step (after forward, "
                               "before optimizer.step()); save checkpoints between steps")
        return self._base_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base_state(state)

    def close(self) -> None:
        self._finish_pending()
        self._hook.remove()
