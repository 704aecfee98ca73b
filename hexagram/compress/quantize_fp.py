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

from dataclasses import dataclass, replace

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
from hexagram.compress.segments import Segments

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
        if self.checks_finite:
            self._check_range(tensor, wire)
        return Payload(tensors=(wire,), shape=tensor.shape, dtype=tensor.dtype)

    def compress_segments(self, flat: Tensor, segments: Segments,
                          generator: torch.Generator | None = None) -> Payload:
        """The whole buffer cast at once: a cast is element-wise, so it is each
        segment's cast (one kernel for the bucket)."""
        payload = self.compress(flat, generator)
        return replace(payload, shape=torch.Size([segments.numel]),
                       meta={"segments": segments})

    def decompress_segments_into(self, payload: Payload, out: Tensor,
                                 add: bool = False) -> Tensor:
        return self.decompress_into(payload, out, add)

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor:
        wire = payload.tensors[0].reshape(-1)
        return out.add_(wire) if add else out.copy_(wire)  # the cast fused into the write

    def _check_range(self, tensor: Tensor, wire: Tensor) -> None:
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
