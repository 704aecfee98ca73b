"""Top-k sparsification (Aji & Heafield 2017) exchanged by allgather of (index, value) pairs.

Each segment (gradient + residual) keeps its ``k = density * numel`` largest magnitudes;
every rank gathers everyone's ``k`` pairs (``(P-1) k`` pairs received, O(kP)) and averages
the sparse vectors. What was not sent stays in the residual (error feedback, on by default:
top-k is biased).

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("topk", density=0.05).config.density
    0.05
"""

from __future__ import annotations

from dataclasses import dataclass

from hexagram import compress
from hexagram.algorithms.compressed import CompressedConfig, CompressorAlgorithm
from hexagram.config import check_float

__all__ = ["TopKAlgorithm", "TopKConfig"]


@dataclass(frozen=True, kw_only=True)
class TopKConfig(CompressedConfig):
    """Config of :class:`TopKAlgorithm` (plus :class:`CompressedConfig`'s fields).

    Attributes:
        approximate: estimate the top-k threshold from a sample (DGC's trick): faster on
            large tensors, same selection (falls back to exact top-k when it misses); on
            by default: ``torch.topk`` over a 10M-element gradient costs about 5x more.
        density: fraction of elements sent per segment; lower => fewer bytes, slower
            convergence.
        error_feedback: keep unsent values for the next step (on: needed for convergence).
    """

    density: float = 0.01
    approximate: bool = True
    error_feedback: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float(self, "density", low=0.0, high=1.0, low_open=True)


class TopKAlgorithm(CompressorAlgorithm):
    """Top-k by allgather with error feedback; see :class:`TopKConfig`."""

    name = "topk"

    def __init__(self, config: TopKConfig | None = None) -> None:
        super().__init__(config or TopKConfig())
        self.config: TopKConfig
        self.use_compressor(compress.get("topk", density=self.config.density,
                                         approximate=self.config.approximate),
                            self.config.error_feedback)
