"""Half-precision gradient allreduce (``fp16``, or ``bf16`` by config).

Each bucket is divided by the world size, cast to 16 bits and summed by allreduce in that
format (BAGUA's C_LP_S with a summable format; PyTorch's ``fp16_compress_hook``): half the
bytes of ``allreduce``. No error feedback: rounding to 16 bits loses about 3 decimal digits,
far below SGD's noise.

fp16 tops out at 65504: a gradient that would overflow after the division by the world size
raises :class:`NonFiniteGradientError` naming the parameter instead of becoming Inf
unnoticed (use ``wire="bf16"``, which has float32's range, or gradient clipping). The range
is checked on the device and read with the step's other checks at the end of backward
(:mod:`hexagram.algorithms.finite`): no host read per bucket.

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("fp16").config.wire
    'fp16'
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from hexagram import compress
from hexagram.algorithms.cast import check_fp16_range
from hexagram.algorithms.compressed import BucketLayout, CompressedConfig, CompressorAlgorithm
from hexagram.compress.base import Payload
from hexagram.config import check_choice

__all__ = ["Fp16Algorithm", "Fp16Config"]

@dataclass(frozen=True, kw_only=True)
class Fp16Config(CompressedConfig):
    """Config of :class:`Fp16Algorithm` (and the fields of :class:`CompressedConfig`).

    Attributes:
        wire: ``"fp16"`` (10-bit mantissa, range +-65504) or ``"bf16"`` (7-bit mantissa,
            float32's range): the same 2 bytes per element either way.
        granularity: casting is element-wise, so it changes only the number of messages:
            ``"bucket"`` (default) sends one allreduce per bucket, ``"layer"`` one per tensor.
    """

    algorithm = "fp16"

    wire: str = "fp16"
    granularity: str = "bucket"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self, "wire", ("fp16", "bf16"))


class Fp16Algorithm(CompressorAlgorithm):
    """16-bit gradient allreduce; see :class:`Fp16Config`."""

    name = "fp16"
    encodes_buckets = True  # the range check before the division
    #: a sum, as allreduce's: a NaN/Inf on one rank reaches every rank in the 16-bit sum,
    #: so the engine checks only what arrives (no per-step agreement message: the bytes
    #: are PyTorch's fp16_compress_hook's)
    passes_nonfinite = True

    def __init__(self, config: Fp16Config | None = None) -> None:
        super().__init__(config or Fp16Config())
        self.config: Fp16Config
        self.use_compressor(compress.get(self.config.wire), feedback=False)  # see above

    def encode_bucket(self, layout: BucketLayout, flat: Tensor, divisor: int) -> Payload:
        """Check fp16's range after the division by P (one check for the bucket, queued
        with the step's checks), then cast (the sum is reduced in 16 bits by
        :func:`hexagram.comm.reduce.reduce_many`: its ``SUM`` route)."""
        if self.config.wire == "fp16":
            check_fp16_range(flat, 1 / self.ctx.comm.size, f"fp16: gradient of "
                             f"{layout.described} at step {self.step}", self.ctx.checks)
        return super().encode_bucket(layout, flat, divisor)
