"""One interface over Hexagram's algorithms and PyTorch DDP's own options (the peers).

Peers: ``ddp`` (DDP's bucketed allreduce), ``ddp-fp16`` (``fp16_compress_hook``),
``ddp-powersgd`` (``powerSGD_hook``, rank 1, compressing from step 2) and ``ddp-localsgd``
(``post_localSGD_hook`` + ``PeriodicModelAverager``, period 4). PyTorch does not count the
bytes it sends, so peers report an estimate from the ring-allreduce formula
``2 (P-1)/P x bytes`` (marked ``estimated``); Hexagram's algorithms report their own counts.

Example:
    >>> wrapped = wrap("ddp-fp16", model, optimizer)      # doctest: +SKIP
    >>> loss_fn(wrapped.model(x), y).backward(); optimizer.step(); wrapped.after_step()
    ... # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["PEERS", "Wrapped", "is_peer", "make_optimizer", "ring_bytes", "wrap"]

PEERS = ("ddp", "ddp-fp16", "ddp-powersgd", "ddp-localsgd")
LOCALSGD_PERIOD = 4
POWERSGD_RANK = 1
POWERSGD_START = 2


@dataclass
class Wrapped:
    """A model ready to train data-parallel, whichever library communicates.

    Attributes:
        model: call it like the original module.
        after_step: call after every ``optimizer.step()``.
        bytes_sent: bytes this rank sent so far (reported by Hexagram, estimated for peers).
        estimated: True when ``bytes_sent`` is a formula, not a count.
        close: release hooks and background work.
        in_backward: True when the link traffic is gradients sent during backward (so it
            can start no earlier than backward produces them); False for model averaging
            after the step.
        decision: what a choosing algorithm (``auto``) decided and its table, else None.
    """

    model: nn.Module
    after_step: Callable[[], None]
    bytes_sent: Callable[[], int]
    estimated: bool
    close: Callable[[], None] = field(default=lambda: None)
    in_backward: bool = True
    decision: Callable[[], dict[str, Any] | None] = field(default=lambda: None)


def is_peer(name: str) -> bool:
    """True for PyTorch DDP's options (``ddp`` and ``ddp-*``)."""
    return name in PEERS


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes each rank sends in a ring allreduce of ``nbytes``."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


def _powersgd_bytes(module: nn.Module) -> int:
    # powerSGD_hook sends P (n x r) and Q (m x r) per matrix worth compressing, and the
    # rest (vectors, small matrices) uncompressed, all in fp32.
    total = 0
    for p in module.parameters():
        n, m = p.shape[0], p.numel() // max(1, p.shape[0])
        low = (n + m) * POWERSGD_RANK
        total += low if p.dim() > 1 and low < n * m else p.numel()
    return 4 * total


def _counting(per_step: int) -> tuple[Callable[[], None], Callable[[], int]]:
    steps = [0]

    def after_step() -> None:
        steps[0] += 1

    return after_step, lambda: steps[0] * per_step


def _wrap_peer(name: str, module: nn.Module, bucket_mb: float | None) -> Wrapped:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    world = dist.get_world_size()
    nbytes = 4 * sum(p.numel() for p in module.parameters() if p.requires_grad)
    # gradients as bucket views, as Hexagram's default: neither side pays a copy the
    # other saves
    ddp = DDP(module, gradient_as_bucket_view=True,
              bucket_cap_mb=None if bucket_mb is None else max(bucket_mb, 1e-6))
    if name == "ddp":
        after, sent = _counting(ring_bytes(nbytes, world))
    elif name == "ddp-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        after, sent = _counting(ring_bytes(nbytes // 2, world))
    elif name == "ddp-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=POWERSGD_RANK,
                                            start_powerSGD_iter=POWERSGD_START,
                                            min_compression_rate=1)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        after, sent = _counting(ring_bytes(_powersgd_bytes(module), world))
    else:
        return _wrap_localsgd(ddp, nbytes, world)
    return Wrapped(ddp, after, sent, estimated=True)


def _wrap_localsgd(ddp: nn.Module, nbytes: int, world: int) -> Wrapped:
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
    from torch.distributed.algorithms.model_averaging import averagers

    # Post-local SGD: allreduce gradients inside each host (its loopback), average the
    # models across all ranks every LOCALSGD_PERIOD steps, as PyTorch's docs recommend.
    per_host = int(torch.distributed.get_world_size() // max(1, _hosts()))
    subgroup, _ = dist.new_subgroups(group_size=per_host)
    state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=subgroup,
                                                 start_localSGD_iter=1)
    ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)  # type: ignore[operator]
    averager = averagers.PeriodicModelAverager(period=LOCALSGD_PERIOD, warmup_steps=1)
    rounds = [0]

    def after_step() -> None:
        # the averager communicates when step >= warmup and (step - warmup) % period == 0
        step = averager.step
        if step >= averager.warmup_steps and (step - averager.warmup_steps) % \
                LOCALSGD_PERIOD == 0:
            rounds[0] += 1
        averager.average_parameters(ddp.parameters())

    def sent() -> int:
        return rounds[0] * ring_bytes(nbytes, world)

    # the hook's allreduce stays inside each host: the link carries only the averaging
    return Wrapped(ddp, after_step, sent, estimated=True, in_backward=False)


def _hosts() -> int:
    import hexagram

    return len(hexagram.get_runtime().hosts)


def make_optimizer(name: str, params: Any, lr: float, adaptive: bool = False,
                   warmup: int = 1) -> torch.optim.Optimizer:
    """The optimizer a run uses with ``name``: SGD with momentum (AdamW if ``adaptive``),
    except ``qadam``, which needs :class:`hexagram.optim.QAdamOptimizer` (its variance frozen
    after ``warmup`` steps, when compression starts)."""
    if name == "qadam":
        from hexagram.optim import QAdamOptimizer

        return QAdamOptimizer(params, lr=lr if adaptive else lr / 10, warmup_steps=max(1, warmup))
    if adaptive:
        return torch.optim.AdamW(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def wrap(name: str, module: nn.Module, optimizer: torch.optim.Optimizer,
         config: Mapping[str, Any] | None = None, bucket_mb: float | None = None) -> Wrapped:
    """Wrap ``module`` for data-parallel training with algorithm or peer ``name``.

    Collective: every rank calls it. Hexagram names come from
    ``hexagram.algorithms.names()``; ``config`` goes to ``hexagram.algorithms.get``.
    ``bucket_mb`` sets the bucket capacity of either library (None: each one's default,
    25 MB; 0: one tensor per bucket).
    """
    if is_peer(name):
        if config:
            raise ValueError(f"{name} takes no config (got {dict(config)})")
        return _wrap_peer(name, module, bucket_mb)
    import hexagram as hx

    algorithm = hx.algorithms.get(name, **dict(config or {}))
    if bucket_mb is None:  # the engine's own defaults
        ddp = hx.DistributedDataParallel(module, optimizers=[optimizer], algorithm=algorithm)
    else:
        ddp = hx.DistributedDataParallel(module, optimizers=[optimizer], algorithm=algorithm,
                                         bucket_size_mb=bucket_mb,
                                         first_bucket_mb=min(1.0, bucket_mb))
    return Wrapped(ddp, lambda: None, ddp.bytes_sent, estimated=False, close=ddp.close,
                   in_backward=algorithm.kind == "grad",
                   decision=lambda: _decision(algorithm))


def _decision(algorithm: Any) -> dict[str, Any] | None:
    """auto's decision and table (JSON-ready), for reports; None for a fixed algorithm."""
    decision = getattr(algorithm, "decision", None)
    if decision is None:
        return None
    return {**decision, "table": getattr(algorithm, "table", None)}
