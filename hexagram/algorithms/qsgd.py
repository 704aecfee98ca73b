"""QSGD (Alistarh et al. 2017): stochastically rounded gradients, unbiased.

Each segment is quantized per ``bucket_size`` elements to ``levels`` levels per sign of its
L2 norm (``qsgd`` compressor) and exchanged by scatter-gather (the format's aggregation):
the mean of the dequantized gradients is unbiased, so no error feedback by default.

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("qsgd", levels=15).config.levels
    15
"""

from __future__ import annotations

from dataclasses import dataclass

from hexagram import compress
from hexagram.algorithms.compressed import CompressedConfig, CompressorAlgorithm
from hexagram.config import check_int

__all__ = ["QSGDAlgorithm", "QSGDConfig"]


@dataclass(frozen=True, kw_only=True)
class QSGDConfig(CompressedConfig):
    """Config of :class:`QSGDAlgorithm` (plus :class:`CompressedConfig`'s fields).

    Attributes:
        levels: s, levels per sign; more => lower variance, more bits per element
            (ceil(log2(2s + 1))).
        bucket_size: elements sharing one norm; smaller => lower variance, more header bytes.
        error_feedback: carry the quantization error to the next step (off: QSGD is unbiased).
    """

    levels: int = 7
    bucket_size: int = 512
    error_feedback: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self, "levels", low=1, high=127)
        check_int(self, "bucket_size", low=1, high=1 << 24)


class QSGDAlgorithm(CompressorAlgorithm):
    """QSGD gradient exchange; see :class:`QSGDConfig`."""

    name = "qsgd"

    def __init__(self, config: QSGDConfig | None = None) -> None:
        super().__init__(config or QSGDConfig())
        self.config: QSGDConfig
        self.use_compressor(compress.get("qsgd", levels=self.config.levels,
                                         bucket_size=self.config.bucket_size,
                                         seed=self.config.seed), self.config.error_feedback)
