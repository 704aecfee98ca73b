"""Shared pieces of the weight-based algorithms (decentralized, local SGD, DiLoCo, async).

- :class:`RoundAlgorithm`: a base for algorithms that communicate in *rounds* (every H
  steps, or every step). It counts optimizer steps, runs the *join* protocol that lets ranks
  with less data finish early, and implements :meth:`RoundAlgorithm.synchronize`.
- :func:`compressed_sum`: sum a tensor over ranks in full precision or with any compressor,
  choosing the collective from the compressor's ``aggregation`` (never guessed).
- Small helpers to move bucket weights in and out and to save flat state by parameter name.

The join protocol (uneven data across ranks): every round starts with a tiny allreduce of
``[active, contributing]`` (two floats). A rank that has run out of data calls
``model.synchronize()``, which keeps answering rounds with ``active = 0`` (its weights still
take part, so it neither blocks its peers nor loses its last local steps) until a round in
which no rank is active; every rank sees that same count, leaves at the same round, and a
final allreduce makes the weights identical. Rounds therefore line up on every rank whatever
the number of local steps, and no rank waits for a peer that has finished.

Example:
    >>> from hexagram.algorithms.weight_sync import as_compressor
    >>> as_compressor(None) is None
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from hexagram import compress
from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.buckets import Bucket
from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.reduce import reduce
from hexagram.compress.base import Aggregation, Compressor
from hexagram.errors import ConfigError

__all__ = [
    "RoundAlgorithm",
    "as_compressor",
    "check_compressor_spec",
    "compressed_sum",
    "flats_from_named",
    "named_from_flats",
    "read_weights",
    "require_optimizers",
    "write_weights",
]

T = TypeVar("T")
U = TypeVar("U")


def as_compressor(spec: str | Compressor | None) -> Compressor | None:
    """A compressor from a registry name (``hexagram.compress.names()``), an instance, or
    ``None`` (full precision)."""
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


def compressed_sum(comm: Communicator, tensor: Tensor, compressor: Compressor | None
                   ) -> Handle[Tensor]:
    """Sum of ``tensor`` over the ranks of ``comm`` (a new tensor; input untouched).

    ``None`` -> full-precision allreduce; ``SUM`` payloads that sum element-wise ->
    compressed allreduce; ``SCATTER_GATHER`` -> scatter-gather; anything else (``GATHER``,
    PowerSGD factors) -> allgather of payloads, then a local sum. Every rank
    receives the same result bit for bit (same payloads, same order of summation).
    """
    if compressor is None:
        return primitives.allreduce(comm, tensor.detach().clone(), average=False)
    if compressor.aggregation is Aggregation.SUM and compressor.payload_sums_elementwise:
        return reduce(comm, tensor.detach(), compressor, reduction="sum")
    if compressor.aggregation is Aggregation.SCATTER_GATHER:
        return primitives.scatter_gather(comm, tensor.detach(), compressor, average=False)
    handle = primitives.allgather_payloads(comm, compressor.compress(tensor.detach()))

    def total(payloads: list[Any]) -> Tensor:
        return torch.stack([compressor.decompress(p) for p in payloads]).sum(0)

    return handle.then(total)


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


class RoundAlgorithm(Algorithm):
    """Base of weight algorithms that communicate in collective rounds (see module doc).

    Subclasses implement :meth:`_round` (one collective round) and may override
    :meth:`_finish_pending` and :meth:`_after_consensus`. ``self.step`` counts steps of the
    first optimizer; ``self.rounds`` counts rounds (identical on every rank);
    ``self.dirty`` is True when local steps were taken since the last round.
    """

    kind = "weight"

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.step = 0
        self.rounds = 0
        self.dirty = False

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        self._optimizer = require_optimizers(ctx, self.name)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is self._optimizer:
            self.step += 1
            self.dirty = True
            self._on_step()

    def _on_step(self) -> None:
        """Called after each counted step (start a round here if it is due)."""

    def _control(self, active: bool, contributing: bool) -> Handle[Tensor]:
        """Start the join allreduce; result ``[ranks active, ranks contributing]``."""
        flags = torch.tensor([float(active), float(contributing)])
        return primitives.allreduce(self.ctx.comm, flags, average=False)

    def _round(self, active: bool) -> int:
        """One collective round; returns how many ranks were active in it."""
        raise NotImplementedError

    def _finish_pending(self) -> None:
        """Complete communication started earlier (e.g. in ``before_forward``)."""

    def _after_consensus(self) -> None:
        """Reset state that refers to the weights after :meth:`synchronize` equalised them."""

    def synchronize(self) -> None:
        """Answer rounds until no rank is active, then average weights over all ranks.

        Collective: every rank calls it once it has no more data (ranks may arrive after
        different numbers of steps). Afterwards every rank holds the same weights.
        """
        self._finish_pending()
        if self.ctx.comm.size > 1:
            while self._round(active=False) > 0:
                pass
            flats = read_weights(self.ctx.buckets)
            for flat in flats:
                primitives.allreduce(self.ctx.comm, flat, average=True).wait()
            write_weights(self.ctx.buckets, flats)
        self.dirty = False
        self._after_consensus()

    def _base_state(self) -> dict[str, Any]:
        return {"step": self.step, "rounds": self.rounds, "dirty": self.dirty}

    def _load_base_state(self, state: dict[str, Any]) -> None:
        self.step, self.rounds = int(state["step"]), int(state["rounds"])
        self.dirty = bool(state["dirty"])
