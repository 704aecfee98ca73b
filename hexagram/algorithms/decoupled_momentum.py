"""DeMo, decoupled momentum (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870).

Each rank keeps its own momentum and sends only its fast components. Per step and tensor
(``g`` the local gradient, ``beta`` the momentum)::

    m <- beta * m + g (+ wd * w)           the momentum stays on the rank
    q <- IDCT(TopK_chunk(DCT(m)))          chunked DCT-II, k of every `chunk` coefficients
    m <- m - q                             what is sent leaves the local momentum
    Q <- mean over ranks of q              allgather of (values, positions), decoded
    w <- w - lr * sign(Q) * rms(Q) / (1 - beta)     rms(Q) = ||Q|| / sqrt(numel), per tensor

The paper applies ``sign(Q)`` with a learning rate tuned for signs (signum). Here, to be a
drop-in with the user's learning rate, the sign is scaled by the RMS of the decoded update
``Q`` (as scaled ``signsgd`` does) and by ``1 / (1 - beta)``: what is sent leaves the
momentum, so a gradient moves the weights about once instead of ``1 / (1 - beta)`` times
as under SGD's momentum; the factor restores SGD's total step. Measured (digits MLP, 4
ranks, the user's SGD lr 0.05 momentum 0.9 taken over, 8 epochs; allreduce 91.5 %): 91.8 %
with the factor, 54.3 % without. The optimizer
runs without momentum on ``sign(Q) * rms(Q)``: with ``momentum=None`` (the default) DeMo
takes over the momentum and weight decay of the user's ``torch.optim.SGD`` (no Nesterov, no
dampening) as DGC does (:mod:`hexagram.algorithms.momentum_correction`), warned at wrap
time and given back at ``close()``. Any other optimizer (Adam, AdamW, Muon, ...) cannot be
taken over: its own moments would act on DeMo's sign update, so the wrap raises
:class:`~hexagram.errors.ConfigError` naming it.

The transform and wire format are :class:`~hexagram.compress.dct.DCTTopKCompressor`'s
(chunk 64 and top-k 32 by default, the paper's; values in bfloat16, positions in 6 bits).
Every rank decodes every rank's payload in rank order: all apply the same bits. The
momenta are saved under ``state["feedback"]["residuals"]`` (the unsent part, as residuals
are), so live elastic mode treats them with its named residual policy
(:mod:`hexagram.elastic.residuals`).

Example:
    >>> DeMoConfig().chunk, DeMoConfig().k
    (64, 32)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hexagram.algorithms.base import AlgorithmContext
from hexagram.algorithms.compressed import (
    CompressedConfig,
    CompressorAlgorithm,
    Segment,
    segments,
)
from hexagram.algorithms.momentum_correction import MomentumCorrection
from hexagram.buckets import Bucket
from hexagram.comm.communicator import Handle
from hexagram.compress.base import Payload
from hexagram.compress.dct import DCTTopKCompressor, DCTTopKConfig
from hexagram.config import check_float
from hexagram.errors import ConfigError

__all__ = ["DeMoAlgorithm", "DeMoConfig", "check_optimizers"]


@dataclass(frozen=True, kw_only=True)
class DeMoConfig(CompressedConfig):
    """Config of :class:`DeMoAlgorithm` (plus :class:`CompressedConfig`'s fields).

    Attributes:
        chunk: elements per DCT chunk (s); larger => finer spectrum, more position bits.
        k: coefficients sent per chunk; fewer => fewer bytes, more kept in the momentum.
        wire_dtype: dtype of the sent values (``"bfloat16"``, ``"float16"``, ``"float32"``).
        momentum: beta; None => the user's SGD momentum, taken over (a drop-in); a number
            => this one (the SGD must then have momentum 0). Higher => smoother.
    """

    algorithm = "decoupled_momentum"

    chunk: int = 64
    k: int = 32
    wire_dtype: str = "bfloat16"
    momentum: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.momentum is not None:
            check_float(self, "momentum", low=0.0, high=1.0, high_open=True)
        DCTTopKConfig(chunk=self.chunk, k=self.k, wire_dtype=self.wire_dtype)
        if self.granularity != "layer":
            raise ConfigError("DeMoConfig.granularity must be 'layer': the momentum and its "
                              "DCT are per tensor")


def check_optimizers(optimizers: list[torch.optim.Optimizer], explicit: bool) -> None:
    """Raise :class:`ConfigError` unless every optimizer is a plain SGD DeMo can run on."""
    for opt in optimizers:
        if type(opt) is not torch.optim.SGD:
            raise ConfigError(
                f"algorithm 'decoupled_momentum' cannot take over {type(opt).__name__}: DeMo "
                "replaces the optimizer's momentum and steps on a sign update, which "
                f"{type(opt).__name__}'s own moments would rescale. Use torch.optim.SGD "
                "(with momentum, taken over) or another algorithm (e.g. 'dgc', 'sparseloco')")
        for group in opt.param_groups:
            if group.get("nesterov") or group.get("dampening"):
                raise ConfigError("algorithm 'decoupled_momentum': SGD with nesterov or "
                                  "dampening cannot be taken over; use plain momentum")
            if not explicit and not group.get("momentum"):
                raise ConfigError("algorithm 'decoupled_momentum': the SGD has no momentum "
                                  "to take over; give SGD momentum (e.g. 0.9) or pass "
                                  "decoupled_momentum momentum=<float>")


class DeMoAlgorithm(MomentumCorrection, CompressorAlgorithm):
    """Decoupled momentum: local momenta, their top DCT components exchanged (module doc)."""

    name = "decoupled_momentum"
    custom_encoding = True

    def __init__(self, config: DeMoConfig | None = None) -> None:
        super().__init__(config or DeMoConfig())
        self.config: DeMoConfig
        c = self.config
        self.use_compressor(DCTTopKCompressor(DCTTopKConfig(
            chunk=c.chunk, k=c.k, wire_dtype=c.wire_dtype)), feedback=False)

    def setup(self, ctx: AlgorithmContext) -> None:
        check_optimizers(list(ctx.optimizers), self.config.momentum is not None)
        super().setup(ctx)

    def refuses(self, optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
        """Why DeMo cannot run on ``optimizers`` (what ``setup`` would raise), or None;
        ``auto`` leaves it out then."""
        try:
            check_optimizers(list(optimizers), self.config.momentum is not None)
        except ConfigError as e:
            return str(e)
        return None

    def encode_segment(self, segment: Segment, tensor: Tensor, divisor: int) -> Payload:
        """m <- beta m + g; send the top DCT components of m; remove them from m."""
        (m,) = self.velocities(segment, tensor)  # layer granularity: one tensor
        payload = self.compressor.compress(m, self.generator)
        m.sub_(self.compressor.decompress(payload).reshape(-1))
        return payload

    def reduce_bucket(self, bucket: Bucket) -> Handle[Tensor]:
        segs = segments(bucket, self.config.granularity)

        def scaled_sign(flat: Tensor) -> Tensor:
            for s in segs:  # Q -> sign(Q) * rms(Q) * gain, per tensor, on the device
                q = flat[s.start:s.stop]
                gain = self.gain(s.entries[0].name) / (q.numel() ** 0.5)
                q.copy_(q.sign() * (torch.linalg.vector_norm(q) * gain))
            return flat

        return super().reduce_bucket(bucket).then(scaled_sign)

    def gain(self, name: str) -> float:
        """Factor of the RMS-scaled sign of tensor ``name``: ``1 / (1 - beta)`` (module
        doc: the step SGD's momentum would make from the same gradients)."""
        beta = self.factors.get(name, (self.config.momentum or 0.0, 0.0))[0]
        return 1.0 / (1.0 - beta)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["feedback"] = {"residuals": state.pop("momenta")}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["momenta"] = state["feedback"]["residuals"]
        state["feedback"] = None
        super().load_state_dict(state)
