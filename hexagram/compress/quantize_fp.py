"""Floating-point casts: ``fp16`` and ``bf16`` (2 bytes per element, summable).

Wire format: the tensor cast to the wire dtype, ``2 * n`` bytes. NaN or Inf in the input
raise :class:`~hexagram.errors.NonFiniteGradientError`; values that overflow the wire
dtype (beyond +-65504 for fp16) raise ``ValueError`` instead of becoming inf.

Example:
    >>> import torch
    >>> from hexagram.compress.quantize_fp import HalfCompressor
    >>> c = HalfCompressor()
    >>> c.compress(torch.ones(10)).nbytes
    20
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hexagram.compress.base import (
    Aggregation,
    Compressor,
    Layout,
    Payload,
    check_compressible,
    check_finite,
)

__all__ = ["BF16Compressor", "CastConfig", "HalfCompressor"]


@dataclass(frozen=True, kw_only=True)
class CastConfig:
    """Casts have no settings."""


class _Cast(Compressor):
    aggregation = Aggregation.SUM
    unbiased = False  # rounding to nearest is deterministic, not unbiased
    wire_dtype: torch.dtype = torch.float16
    memory_passes = 3.0  # read the gradient, write the cast, read it back on decode

    def __init__(self, config: CastConfig | None = None) -> None:
        self.config = config or CastConfig()

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        """The input's shape in the wire dtype."""
        return ((shape, self.wire_dtype),)

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        check_compressible(tensor, self.name)
        wire = tensor.detach().to(self.wire_dtype)
        if not self.checks_finite:  # the caller's check sees NaN/Inf and overflow's Inf
            return Payload(tensors=(wire,), shape=tensor.shape, dtype=tensor.dtype)
        # NaN/Inf in the input or from overflow make the min or max non-finite; a minimum and
        # a maximum cannot overflow (a float64 sum of the 16-bit values cost 15x more)
        probe = torch.stack(torch.aminmax(wire))
        if not bool(torch.isfinite(probe).all()):
            check_finite(tensor, self.name)
            raise ValueError(
                f"{self.name}: values beyond +-{torch.finfo(self.wire_dtype).max:g} overflow "
                f"{self.wire_dtype} to inf; scale the tensor down first (e.g. divide by the "
                "world size) or use bf16"
            )
        return Payload(tensors=(wire,), shape=tensor.shape, dtype=tensor.dtype)

    def decompress(self, payload: Payload) -> Tensor:
        return payload.tensors[0].to(payload.dtype).reshape(payload.shape)


class HalfCompressor(_Cast):
    """IEEE half precision; values beyond +-65504 overflow to inf (divide before summing)."""

    name = "fp16"
    wire_dtype = torch.float16


class BF16Compressor(_Cast):
    """bfloat16: float32's range with 8 bits of mantissa."""

    name = "bf16"
    wire_dtype = torch.bfloat16
