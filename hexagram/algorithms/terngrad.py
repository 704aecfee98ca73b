"""TernGrad (Wen et al. 2017): ternary gradients {-s, 0, +s}.

Each segment (a layer, by default: TernGrad's layer-wise scaling keeps ``s = max|g|`` small)
is clipped to ``clip`` standard deviations, then becomes ``s * sign(g) * b`` with
``b ~ Bernoulli(|g| / s)``: 2 bits per element plus one scale. Payloads cannot be summed, so
every rank gathers all of them and averages. Unbiased apart from the clipping, so no error
feedback by default.

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("terngrad").config.error_feedback
    False
"""

from __future__ import annotations

from dataclasses import dataclass

from hexagram import compress
from hexagram.algorithms.compressed import CompressedConfig, CompressorAlgorithm
from hexagram.config import check_float

__all__ = ["TernGradAlgorithm", "TernGradConfig"]


@dataclass(frozen=True, kw_only=True)
class TernGradConfig(CompressedConfig):
    """Config of :class:`TernGradAlgorithm` (plus :class:`CompressedConfig`'s fields).

    Attributes:
        clip: clip ``|g|`` to ``clip * std(g)`` before ternarizing (the paper's 2.5): a
            smaller scale ``s`` and variance, a little bias; 0 => no clipping.
        error_feedback: carry the ternarization error to the next step (off: unbiased).
    """

    clip: float = 2.5
    error_feedback: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float(self, "clip", low=0.0)


class TernGradAlgorithm(CompressorAlgorithm):
    """Ternary gradient exchange; see :class:`TernGradConfig`."""

    name = "terngrad"

    def __init__(self, config: TernGradConfig | None = None) -> None:
        super().__init__(config or TernGradConfig())
        self.config: TernGradConfig
        self.use_compressor(compress.get("terngrad", clip=self.config.clip,
                                         seed=self.config.seed), self.config.error_feedback)
