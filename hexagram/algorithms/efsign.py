"""EF-signSGD (Karimireddy et al. 2019): scaled signs ``(||g||_1 / d) sign(g)`` plus error
feedback.

Each segment (gradient + residual) is sent as one bit per element and its mean magnitude;
the compression error goes back into the residual, which makes the biased sign compressor
converge like SGD. Every rank gathers all payloads and averages them.

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("efsign").config.error_feedback
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from hexagram import compress
from hexagram.algorithms.compressed import CompressedConfig, CompressorAlgorithm

__all__ = ["EFSignAlgorithm", "EFSignConfig"]


@dataclass(frozen=True, kw_only=True)
class EFSignConfig(CompressedConfig):
    """Config of :class:`EFSignAlgorithm` (plus :class:`CompressedConfig`'s fields).

    Attributes:
        error_feedback: carry the sign error to the next step (on: the method needs it).
    """

    error_feedback: bool = True


class EFSignAlgorithm(CompressorAlgorithm):
    """Scaled-sign gradient exchange with error feedback; see :class:`EFSignConfig`."""

    name = "efsign"

    def __init__(self, config: EFSignConfig | None = None) -> None:
        super().__init__(config or EFSignConfig())
        self.config: EFSignConfig
        self.use_compressor(compress.get("efsign"), self.config.error_feedback)
