"""Float values to integer codes: truncation and unbiased stochastic rounding.

Shared by the quantizers (:mod:`hexagram.compress.quantize`): codes are uint8, computed
block by block into :func:`~hexagram.compress.packing.encode_blocks`' buffers. The CPU
takes numpy where torch's kernels are slow (float -> uint8 casts, random bits); other
devices (and the CPU with :data:`~hexagram.compress.packing.CPU_FAST_PATHS` off) stay in
torch, reading nothing back, or take the fused kernel of :mod:`hexagram.compress.kernels`
where it is available (CUDA): the same draws, the same codes.

Example:
    >>> import torch
    >>> codes = torch.empty(3, dtype=torch.uint8)
    >>> truncate_to(codes, torch.tensor([0.5, 1.9, 254.99]), torch.empty(3, dtype=torch.int32))
    tensor([  0,   1, 254], dtype=torch.uint8)
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from hexagram.compress import kernels
from hexagram.compress.chunks import fma_rows
from hexagram.compress.packing import block_size, cpu_fast, encode_blocks, random_words

__all__ = ["random_words", "stochastic_codes", "truncate_to"]


def truncate_to(codes: Tensor, values: Tensor, ints: Tensor) -> Tensor:
    """``codes`` (uint8) := ``trunc(values)`` for values in [0, 256).

    On the CPU numpy casts float32/float64 to uint8 in one vectorized pass (0.08 ms per
    508K float32 values, one thread); torch's float -> uint8 is not vectorized (0.30 ms),
    so elsewhere it goes through ``ints`` (an int32 buffer at least as long), float ->
    int32 -> uint8 (0.19 ms there). Both truncate toward zero: the same codes.
    """
    if cpu_fast(codes) and values.dtype in (torch.float32, torch.float64):
        np.copyto(codes.numpy(), values.numpy(), casting="unsafe")
        return codes
    return codes.copy_(ints[: values.numel()].copy_(values))


def stochastic_codes(flat: Tensor, chunk: int, scale: Tensor, levels: int,
                     gen: torch.Generator, pre: Tensor | None = None,
                     packed: bool = True) -> Tensor:
    """Packed codes ``floor(x * scale[chunk] + u) + levels``, ``u ~ U(0, 1)``, clamped to
    ``[0, 2 * levels]``: the unbiased stochastic rounding of ``x * scale`` to an integer
    in ``[-levels, levels]`` (values beyond are clipped), in ceil(log2(2s + 1)) bits.
    ``pre`` (per chunk, a power of two) multiplies ``x`` first, for scales beyond
    ``scale.dtype``'s range split in two without reading which chunks need it.
    ``packed=False``: one code per byte, unpacked (``chunk=1`` with per-element ``scale``
    rounds every element with its own scale).

    Off the CPU's fast paths, one fused kernel where :func:`kernels.dispatch` allows
    (it draws the dither in one piece, as the eager code does in its one block there).
    """
    s, n = levels, flat.numel()
    block = block_size(flat.device)
    if not cpu_fast(flat) and n <= block and kernels.dispatch(flat):
        return kernels.stochastic_codes(flat, chunk, scale, levels, gen, pre, packed)
    tmp = torch.empty(min(block, n), dtype=scale.dtype, device=flat.device)
    shift = torch.full((1,), s + 0.5 + 2.0**-17, dtype=scale.dtype,
                       device=flat.device).expand(scale.numel())
    dither = torch.empty_like(tmp)
    ints = torch.empty(tmp.numel(), dtype=torch.int32, device=flat.device)
    draw = random_words(gen, flat.device)

    def fill(start: int, stop: int, codes: Tensor) -> None:
        length = stop - start
        buf = tmp[:length]
        # x * scale + s + 0.5 + 2**-17, with x * scale in [-s, s] (beyond only when clipping)
        if pre is None:
            fma_rows(buf, flat[start:stop], start, chunk, scale, shift)
        else:
            fma_rows(buf, flat[start:stop], start, chunk, pre, None)
            fma_rows(buf, buf, start, chunk, scale, shift)
        # 16 random bits per element: u = (r + 32768.5) / 65536 in (0, 1), r an int16
        rnd = draw(-(-length // 4))
        dither[:length].copy_(rnd.view(torch.int16)[:length])
        buf.add_(dither[:length], alpha=2.0**-16)
        # trunc(x * scale + u + s) = floor(x * scale + u) + s; values below 0 only when
        # clipping (trunc toward 0 is then right too), above 2s only by rounding or clipping
        truncate_to(codes, buf.clamp_(0, 2 * s), ints)

    return encode_blocks(n, (2 * s).bit_length() if packed else 8, fill, flat.device, block)
