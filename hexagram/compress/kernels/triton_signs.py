# Triton types a kernel's parameters at launch (tl.constexpr marks the compile-time ones)
# mypy: disable-error-code="no-untyped-def"
"""Triton kernel of the sign bits behind ``sign``, ``efsign`` and ``onebit``: bit 1 where
``x >= 0`` (zero and -0.0 count as positive, NaN as negative), element ``i`` at bit
``i % 8`` of byte ``i // 8``, the last byte padded with zeros: the bits of
:func:`hexagram.compress.sign_bits.encode_signs`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hexagram.compress.kernels.triton_bits import FP_OPTIONS, GROUPS, store_packed, tile

__all__ = ["launch_signs"]


@triton.jit
def _signs_kernel(x_ptr, out_ptr, n, nbytes, GROUPS: tl.constexpr):
    idx, g, m = tile(tl.program_id(0), n, GROUPS)
    x = tl.load(x_ptr + idx, mask=m, other=0)
    store_packed(out_ptr, (x >= 0).to(tl.int32), g, m, nbytes, 1)


def launch_signs(flat: Tensor) -> Tensor:
    """``ceil(n / 8)`` bytes of packed sign bits of ``flat``."""
    n = flat.numel()
    nbytes = (n + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    _signs_kernel[(triton.cdiv(n, 8 * GROUPS),)](flat, out, n, nbytes, GROUPS=GROUPS,
                                                 **FP_OPTIONS)
    return out
