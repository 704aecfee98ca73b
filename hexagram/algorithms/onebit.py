"""1-bit SGD (Seide et al. 2014): one bit per element, error feedback on.

Each segment is sent as its signs plus reconstruction values (``onebit`` compressor); what
the 1-bit code loses is added to the next step's gradient (error feedback), without which
1-bit SGD does not converge. Payloads are gathered by every rank and averaged.

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("onebit").config.error_feedback
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from hexagram import compress
from hexagram.algorithms.compressed import CompressedConfig, CompressorAlgorithm

__all__ = ["OneBitAlgorithm", "OneBitConfig"]


@dataclass(frozen=True, kw_only=True)
class OneBitConfig(CompressedConfig):
    """Config of :class:`OneBitAlgorithm` (plus :class:`CompressedConfig`'s fields).

    Attributes:
        error_feedback: carry the quantization error to the next step (on: 1-bit codes are
            strongly biased).
    """

    error_feedback: bool = True


class OneBitAlgorithm(CompressorAlgorithm):
    """1-bit gradient exchange with error feedback; see :class:`OneBitConfig`."""

    name = "onebit"

    def __init__(self, config: OneBitConfig | None = None) -> None:
        super().__init__(config or OneBitConfig())
        self.config: OneBitConfig
        self.use_compressor(compress.get("onebit"), self.config.error_feedback)
