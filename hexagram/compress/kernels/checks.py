"""Argument checks of the fused kernels' API (host-side facts only: shapes, dtypes,
layouts; nothing is read from a device).

Example:
    >>> import torch
    >>> check_flat(torch.ones(3), "sign_bits")
    >>> check_chunks(0, "chunk")
    Traceback (most recent call last):
    ...
    ValueError: chunk must be a positive int, got 0
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FLOATS", "check_chunks", "check_flat", "check_out", "check_packed", "check_starts"]

#: input dtypes the kernels take
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_flat(flat: Tensor, who: str) -> None:
    """``flat`` must be a non-empty 1-D contiguous float tensor."""
    if flat.dim() != 1 or not flat.is_contiguous() or flat.dtype not in FLOATS:
        raise ValueError(f"{who}: needs a 1-D contiguous float16/bfloat16/float32/float64 "
                         f"tensor, got {flat.dtype} of shape {tuple(flat.shape)}; pass "
                         "tensor.detach().reshape(-1).contiguous()")
    if flat.numel() == 0:
        raise ValueError(f"{who}: the tensor is empty")


def check_chunks(chunk: int, what: str) -> None:
    """A chunk size must be a positive int."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{what} must be a positive int, got {chunk!r}")


def check_packed(packed: Tensor, bits: int, n: int, who: str) -> None:
    """``packed`` must hold exactly ``ceil(n * bits / 8)`` uint8, contiguous."""
    if not 1 <= bits <= 8:
        raise ValueError(f"{who}: bits must be in [1, 8], got {bits}")
    nbytes = (n * bits + 7) // 8
    if packed.dtype != torch.uint8 or packed.dim() != 1 or not packed.is_contiguous() \
            or packed.numel() != nbytes:
        raise ValueError(f"{who}: {n} codes of {bits} bits take {nbytes} contiguous uint8 "
                         f"bytes, got {packed.dtype} of shape {tuple(packed.shape)}")


def check_out(out: Tensor, n: int, who: str) -> None:
    """``out`` must be a 1-D contiguous float tensor of ``n`` elements."""
    if out.dim() != 1 or out.numel() != n or not out.is_contiguous() or out.dtype not in FLOATS:
        raise ValueError(f"{who}: out must be a 1-D contiguous float tensor of {n} elements, "
                         f"got {out.dtype} of shape {tuple(out.shape)}")


def check_starts(starts: Tensor, n: int) -> None:
    """``starts`` must be a 1-D int64 tensor of 1 to ``n`` segment starts."""
    if starts.dtype != torch.int64 or starts.dim() != 1 or not 1 <= starts.numel() <= n \
            or not starts.is_contiguous():
        raise ValueError(f"finite_clean: starts must be a 1-D contiguous int64 tensor of 1 to "
                         f"{n} segment starts (Segments.device_offsets), got {starts.dtype} "
                         f"of shape {tuple(starts.shape)}")
