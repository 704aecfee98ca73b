"""Chunked DCT-II top-k: DeMo's extraction of the fast components of a tensor.

The flat tensor of ``n`` elements is cut into ``G = ceil(n / c)`` chunks of ``c =
min(chunk, n)`` elements (the last one zero-padded); each chunk goes through the
orthonormal DCT-II (``X = D x``, ``D[f, t] = sqrt(2/c) a_f cos(pi (2t + 1) f / (2c))``,
``a_0 = 1/sqrt(2)``, else 1: the transform of ``scipy.fft.dct(type=2, norm="ortho")``), and
the ``k' = min(k, c)`` coefficients of largest magnitude are kept. Decoding puts them back
in a zero spectrum and applies ``D^T`` (the inverse, ``D`` being orthonormal).

Wire format: values (G, k') in ``wire_dtype`` (bfloat16 by default: DeMo applies the sign
of the gathered update, so the values' low bits matter little) + positions of
``b = bit_length(c - 1)`` bits, packed (:func:`~hexagram.compress.chunk_topk.
pack_positions`): ``nbytes = G k' itemsize + ceil(G k' b / 8)``. Payloads do not sum
(``Aggregation.GATHER``). The DCT matrix is a small table cached per size, device and dtype.
NaN/Inf are refused on the CPU; on an accelerator ``compress`` reads nothing back to the
host (DeMo compresses every tensor every step; its gradients were checked per bucket).

Example:
    >>> import torch
    >>> c = DCTTopKCompressor(DCTTopKConfig(chunk=4, k=1, wire_dtype="float32"))
    >>> x = torch.tensor([1.0, 1.0, 1.0, 1.0])  # all its energy at frequency 0
    >>> [round(v, 5) for v in c.decompress(c.compress(x)).tolist()], c.compress(x).nbytes
    ([1.0, 1.0, 1.0, 1.0], 5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hexagram.compress.base import (
    Aggregation,
    Compressor,
    Layout,
    Payload,
    check_compressible,
    decompress_via_into,
    ensure_finite,
)
from hexagram.compress.chunk_topk import check_chunk_payload, pack_positions, unpack_positions
from hexagram.compress.chunks import padded_rows, work_dtype
from hexagram.compress.faults import any_of, beyond, row_positions
from hexagram.compress.packing import packed_nbytes
from hexagram.config import check_choice, check_int

__all__ = ["WIRE_DTYPES", "DCTTopKCompressor", "DCTTopKConfig", "dct_layout", "dct_matrix"]

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}
_TABLES: dict[tuple[int, str, torch.dtype], Tensor] = {}


@dataclass(frozen=True, kw_only=True)
class DCTTopKConfig:
    """Settings of :class:`DCTTopKCompressor`.

    Attributes:
        chunk: elements per DCT chunk (DeMo's s, 64); larger => a finer spectrum, one more
            position bit per doubling.
        k: coefficients kept per chunk (DeMo's top-k, 32); fewer => fewer bytes, more left
            in the local momentum.
        wire_dtype: dtype of the values on the wire: ``"bfloat16"``, ``"float16"`` or
            ``"float32"``; narrower => fewer bytes.
    """

    chunk: int = 64
    k: int = 32
    wire_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        check_int(self, "chunk", low=1, high=1 << 16)
        check_int(self, "k", low=1)
        check_choice(self, "wire_dtype", tuple(WIRE_DTYPES))


def dct_layout(config: DCTTopKConfig, n: int) -> tuple[int, int, int, int]:
    """``(c, G, k', b)``: chunk length, chunks, kept per chunk, position bits."""
    c = min(config.chunk, n)
    return c, -(-n // c), min(config.k, c), max(1, (c - 1).bit_length())


def dct_matrix(size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The orthonormal DCT-II matrix ``D`` (size, size), cached per device and dtype."""
    key = (size, str(device), dtype)
    if key not in _TABLES:
        t = torch.arange(size, dtype=torch.float64)
        d = torch.cos(math.pi * (2 * t[None, :] + 1) * t[:, None] / (2 * size))
        d *= math.sqrt(2 / size)
        d[0] /= math.sqrt(2)
        _TABLES[key] = d.to(device=device, dtype=dtype)
    return _TABLES[key]


class DCTTopKCompressor(Compressor):
    """Top-k DCT-II coefficients per chunk (module doc)."""

    name = "dcttopk"
    aggregation = Aggregation.GATHER
    unbiased = False
    #: beyond the two transforms' FLOPs: the padded copy (2), the spectrum written (1), its
    #: magnitudes (2), the top-k (1); the decode's zero-filled spectrum, read by the inverse
    #: transform, and its output (3)
    memory_passes = 9.0

    def __init__(self, config: DCTTopKConfig | None = None) -> None:
        self.config = config or DCTTopKConfig()

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        check_compressible(tensor, self.name)
        n = tensor.numel()
        c, g, k, b = dct_layout(self.config, n)
        wd = work_dtype(tensor.dtype)
        rows = padded_rows(tensor, g, c, wd)
        spectrum = rows @ dct_matrix(c, tensor.device, wd).T  # (G, c)
        mags, pos = spectrum.abs().topk(k, dim=1)  # sorted: a deterministic order
        if self.checks_finite:  # a host read; DeMo turns it off and checks once per step
            ensure_finite(tensor, mags[:, 0], self.name)  # NaN sorts first: non-finite
        values = spectrum.gather(1, pos).to(WIRE_DTYPES[self.config.wire_dtype])
        return Payload(tensors=(values, pack_positions(pos, b)), shape=tensor.shape,
                       dtype=tensor.dtype)

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        """:meth:`layout` of the ``prod(shape)`` elements (what the cost model reads)."""
        return self.layout(math.prod(shape), dtype)

    def layout(self, n: int, dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], torch.dtype],
                                                          ...]:
        """Shape and dtype of each payload tensor for ``n`` elements (module doc)."""
        _, g, k, b = dct_layout(self.config, n)
        return (((g, k), WIRE_DTYPES[self.config.wire_dtype]),
                ((packed_nbytes(g * k, b),), torch.uint8))

    def decompress(self, payload: Payload) -> Tensor:
        return decompress_via_into(self, payload)

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor:
        n = payload.shape.numel()
        c, g, k, b = dct_layout(self.config, n)
        values, packed = payload.tensors
        check_chunk_payload(self.name, values.shape == (g, k) and
                            packed.numel() == packed_nbytes(g * k, b), g, c, k)
        wd = work_dtype(payload.dtype)
        spectrum = torch.zeros(g, c, dtype=wd, device=values.device)
        pos = unpack_positions(packed, b, g * k).view(g, k)
        vals = values.to(wd)
        if c & (c - 1):  # ``b`` bits can name more than ``c``: clamped, their values zeroed
            vals = torch.where(pos < c, vals, 0.0)
            pos = pos.clamp_(max=c - 1)
        spectrum.scatter_(1, pos, vals)
        dense = (spectrum @ dct_matrix(c, values.device, wd)).reshape(-1)[:n]
        return out.add_(dense.to(out.dtype)) if add else out.copy_(dense)

    def payload_fault(self, payload: Payload) -> Tensor:
        """Coefficients NaN/Inf, or large enough that ``k`` of them could overflow the
        inverse transform; a position past its chunk or repeated in it (no host read)."""
        c, g, k, b = dct_layout(self.config, payload.shape.numel())
        values, packed = payload.tensors
        pos = unpack_positions(packed, b, g * k).view(g, k)
        return any_of([beyond(values, payload.dtype, factor=k), row_positions(pos, c)])

    def __repr__(self) -> str:
        return f"DCTTopKCompressor({self.config})"
