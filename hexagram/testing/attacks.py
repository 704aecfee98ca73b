"""Byzantine attacks on the outgoing gradients of chosen ranks, for tests and benchmarks.

:func:`corrupt` is the pure attack: what a Byzantine rank sends instead of its gradient
``own``, possibly knowing the honest ranks' gradients (ALIE and IPM are *omniscient*).
:class:`AttackedAlgorithm` applies it to any gradient algorithm without touching its code:
it wraps the algorithm and rewrites ``bucket.flat`` on the Byzantine ranks before the inner
algorithm's ``bucket_ready`` sends it. For the omniscient attacks the *harness* gathers every
rank's bucket on a process group of its own (not the algorithm's communicator, so those
bytes are not counted as the algorithm's). ``label_flip`` leaves gradients alone: the harness
flips the training labels of the Byzantine ranks (:func:`flip_labels`).

Attacks (defaults as in ByzFL):

- ``sign_flip``: ``-g``; ``scale``: ``-10 g``; ``gaussian``: ``N(0, sigma^2)`` per element;
- ``alie`` (Baruch et al. 2019): ``mean + tau * std`` of the honest gradients, tau 1.5;
- ``ipm`` (Xie et al. 2020): ``-tau * mean`` of the honest gradients, tau 2;
- ``label_flip``: train on labels ``classes - 1 - y``; ``nan``: every element NaN;
- byte attacks (:mod:`hexagram.testing.byte_attacks`): ``malformed``,
  ``index_out_of_range``, ``nan_scale`` corrupt the attacking ranks' *payloads* after
  encoding (a :class:`~hexagram.testing.byte_attacks.CorruptingCompressor` put in place of
  the algorithm's compressor at set-up); an algorithm without a compressor sends its
  vector's bytes as they are, so those are corrupted instead (``index_out_of_range`` then
  finds no index and leaves it alone).

Example:
    >>> import torch
    >>> corrupt("scale", torch.tensor([1.0, -2.0]))
    tensor([-10.,  20.])
    >>> corrupt("alie", torch.zeros(2), honest=torch.tensor([[0.0, 1.0], [2.0, 1.0]]))
    tensor([3.1213, 1.0000])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hexagram.algorithms.base import Algorithm, AlgorithmContext, Forwarding
from hexagram.buckets import Bucket
from hexagram.comm.communicator import Handle
from hexagram.comm.shards import all_gather_flat
from hexagram.compress.base import Compressor
from hexagram.testing.byte_attacks import BYTE_ATTACKS, CorruptingCompressor, corrupt_tensors

__all__ = ["ATTACKS", "BYTE_ATTACKS", "OMNISCIENT", "AttackConfig", "AttackedAlgorithm",
           "byzantine_ranks", "check_attack", "corrupt", "corrupt_compressors", "flip_labels"]

ATTACKS = ("sign_flip", "scale", "gaussian", "alie", "ipm", "label_flip", "nan", *BYTE_ATTACKS)
OMNISCIENT = ("alie", "ipm")


def check_attack(name: str) -> None:
    """Raise ``ValueError`` listing the valid attacks when ``name`` is not one."""
    if name not in ATTACKS:
        raise ValueError(f"unknown attack {name!r}; valid attacks: {', '.join(ATTACKS)}")


def byzantine_ranks(f: int, world_size: int) -> tuple[int, ...]:
    """The ``f`` Byzantine ranks: the last ones (rank 0, which logs, stays honest)."""
    if not 0 <= f < world_size:
        raise ValueError(f"--byzantine {f} needs 0 <= f < world size {world_size}")
    return tuple(range(world_size - f, world_size))


def corrupt(name: str, own: Tensor, honest: Tensor | None = None, *, scale: float = -10.0,
            sigma: float = 1.0, tau: float | None = None,
            generator: torch.Generator | None = None) -> Tensor:
    """What a Byzantine rank sends instead of ``own`` (a new tensor, same shape).

    ``honest`` ``(h, d)`` holds the honest ranks' gradients, needed by ``alie`` and ``ipm``;
    ``tau`` defaults to 1.5 (ALIE) / 2.0 (IPM).
    """
    check_attack(name)
    if name in ("sign_flip", "scale"):
        return own * (-1.0 if name == "sign_flip" else scale)
    if name == "gaussian":
        noise = torch.randn(own.shape, generator=generator, dtype=own.dtype)
        return noise.to(own.device) * sigma
    if name == "nan":
        return torch.full_like(own, float("nan"))
    if name == "label_flip":
        return own.clone()
    if name in BYTE_ATTACKS:  # the vector's own bytes: what crosses the wire uncompressed
        return corrupt_tensors(name, (own.detach().clone(),), own.numel(), generator)[0]
    if honest is None or honest.shape[0] == 0:
        raise ValueError(f"attack {name!r} is omniscient: pass the honest gradients")
    mean = honest.mean(dim=0).view_as(own)
    if name == "ipm":
        return mean * -(2.0 if tau is None else tau)
    std = honest.std(dim=0, correction=1).view_as(own) if honest.shape[0] > 1 \
        else torch.zeros_like(own)
    return mean + (1.5 if tau is None else tau) * std


def flip_labels(y: Tensor, classes: int) -> Tensor:
    """Label flipping: class ``c`` becomes ``classes - 1 - c``."""
    return classes - 1 - y


@dataclass(frozen=True, kw_only=True)
class AttackConfig:
    """Who attacks and how.

    Attributes:
        name: one of :data:`ATTACKS`.
        ranks: the Byzantine group ranks.
        scale: factor of ``scale``; sigma: standard deviation of ``gaussian``;
        tau: ALIE / IPM strength (None: 1.5 / 2.0); seed: ``gaussian``'s noise.
    """

    name: str
    ranks: tuple[int, ...]
    scale: float = -10.0
    sigma: float = 1.0
    tau: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_attack(self.name)


class AttackedAlgorithm(Forwarding):
    """Wraps a gradient algorithm; Byzantine ranks send :func:`corrupt`'s vector instead.

    Every hook is the inner algorithm's; only ``bucket_ready`` rewrites the bucket first.
    Collective at ``setup`` (the omniscient attacks create a process group).
    """

    name = "attacked"
    kind = "grad"

    def __init__(self, inner: Algorithm, attack: AttackConfig) -> None:
        if inner.kind != "grad":
            raise ValueError(f"attacks corrupt outgoing gradients; {inner.name!r} communicates "
                             "weights: use a gradient algorithm")
        super().__init__(inner)
        self.attack = attack
        self._group: Any = None
        self._generator = torch.Generator()
        #: the byte attack's compressor wrappers on this rank (None: not a byte attack or
        #: not an attacking rank; empty: no compressor, the vector's bytes are corrupted)
        self.corrupting: list[CorruptingCompressor] | None = None

    def setup(self, ctx: AlgorithmContext) -> None:
        if self.attack.name in OMNISCIENT and ctx.comm.size > 1:
            self._group = dist.new_group(ctx.comm.global_ranks)  # the harness's own group
        self._generator.manual_seed(self.attack.seed * 1_000_003 + ctx.comm.rank)
        super().setup(ctx)  # then the inner algorithm's (collective) set-up
        self.corrupting = None
        if self.attack.name in BYTE_ATTACKS and ctx.comm.rank in self.attack.ranks:
            self.corrupting = corrupt_compressors(
                self.inner, self.attack.name, self.attack.seed * 1_000_003 + ctx.comm.rank)

    def bucket_ready(self, bucket: Bucket) -> Handle[Tensor] | None:
        comm = self.ctx.comm
        honest = self._honest(bucket.flat) if self.attack.name in OMNISCIENT else None
        if comm.rank in self.attack.ranks and not self.corrupting:
            a = self.attack
            bad = corrupt(a.name, bucket.flat, honest, scale=a.scale, sigma=a.sigma, tau=a.tau,
                          generator=self._generator)
            bucket.flat.copy_(bad)
        return self.inner.bucket_ready(bucket)

    def _honest(self, flat: Tensor) -> Tensor:
        """Every honest rank's bucket ``(h, d)``, gathered by the harness (omniscience)."""
        size = self.ctx.comm.size
        if size == 1:
            return flat.detach()[None].clone()
        out = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
        all_gather_flat(out, flat.detach().contiguous(), self._group)
        keep = [r for r in range(size) if r not in self.attack.ranks]
        return out.view(size, -1)[keep]

    def close(self) -> None:
        self.inner.close()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


def corrupt_compressors(algorithm: Algorithm, attack: str, seed: int
                        ) -> list[CorruptingCompressor]:
    """Put a :class:`~hexagram.testing.byte_attacks.CorruptingCompressor` in place of every
    compressor ``algorithm`` (or the algorithm it wraps) encodes with: its ``compressor``
    and its error feedback's. Returns the wrappers (empty: the algorithm compresses
    nothing, so the caller corrupts the vector itself)."""
    inner: Any = algorithm
    while hasattr(inner, "inner") and isinstance(inner.inner, Algorithm):
        inner = inner.inner
    found = getattr(inner, "compressor", None)
    if not isinstance(found, Compressor):
        return []
    comp: Compressor = found
    device = inner.ctx.runtime.device if inner.is_set_up else None
    wrapped = [CorruptingCompressor(comp, attack, seed, device=device)]
    inner.compressor = wrapped[0]
    feedback = getattr(inner, "error_feedback", None)
    if feedback is not None and getattr(feedback, "compressor", None) is comp:
        # its own wrapper: the residual is decoded from the payload as it really was
        wrapped.append(CorruptingCompressor(comp, attack, seed, device=device,
                                            keep_own=True))
        feedback.compressor = wrapped[1]
    if getattr(inner, "picks_compressor", False):
        # its encoder picks a compressor per step (DGC's density warm-up), not the one
        # wrapped above: what the encoder returns is corrupted, after the algorithm kept
        # its own residual from the real payload (as with bytes corrupted in transit)
        encode, wire = inner.encode_bucket, wrapped[0]
        inner.encode_bucket = lambda *args: wire.corrupt(encode(*args))
    return wrapped
