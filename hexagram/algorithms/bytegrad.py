"""ByteGrad (BAGUA): 8-bit min-max quantized gradients by scatter-gather.

Each bucket is cut into P chunks; every rank quantizes its chunks to 8 bits (``minmax8``: a
min and a step per ``chunk_size`` elements), an all-to-all hands chunk j to rank j, which
dequantizes and averages the P copies, re-quantizes the mean and allgathers it. Wire bytes
per rank: ``2 (P-1)/P`` of the 8-bit payload, about a quarter of float32 allreduce. No error
feedback (as BAGUA): the 8-bit error is small and unbiased enough in practice.

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("bytegrad", chunk_size=256).config.granularity
    'bucket'
"""

from __future__ import annotations

from dataclasses import dataclass

from hexagram import compress
from hexagram.algorithms.compressed import CompressedConfig, CompressorAlgorithm
from hexagram.config import check_int

__all__ = ["ByteGradAlgorithm", "ByteGradConfig"]


@dataclass(frozen=True, kw_only=True)
class ByteGradConfig(CompressedConfig):
    """Config of :class:`ByteGradAlgorithm` (plus :class:`CompressedConfig`'s fields).

    Attributes:
        chunk_size: elements sharing one (min, step) pair; smaller => finer scales, more
            header bytes (8 per chunk).
        granularity: ``"bucket"`` (default, as BAGUA: one scatter-gather per bucket) or
            ``"layer"`` (one per tensor: more, smaller messages).
    """

    chunk_size: int = 1024
    granularity: str = "bucket"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self, "chunk_size", low=1, high=1 << 24)


class ByteGradAlgorithm(CompressorAlgorithm):
    """8-bit scatter-gather gradient reduction; see :class:`ByteGradConfig`."""

    name = "bytegrad"

    def __init__(self, config: ByteGradConfig | None = None) -> None:
        super().__init__(config or ByteGradConfig())
        self.config: ByteGradConfig
        self.use_compressor(compress.get("minmax8", chunk_size=self.config.chunk_size),
                            feedback=False)
