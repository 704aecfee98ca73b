"""Selecting (index, value) pairs for the sparsifiers of :mod:`hexagram.compress.sparsify`:
the entries above a threshold, block by block (:func:`above`), the largest of a set of
candidates (:func:`largest`), put in the wire's order (:func:`ascending`); and what their
decoders share: the dense tensor of the pairs (:func:`scatter`, safe on any indices) and the
check of received pairs (:func:`pairs_fault`).

The pair formats send their indices strictly increasing: a receiver then checks for a
repeated index by comparing neighbours, in one pass over each payload, instead of sorting
every payload it receives (the sender sorts its own once).

Example:
    >>> import torch
    >>> idx, val = above(torch.tensor([0.1, -3.0, 2.0]), 1.0)
    >>> idx.tolist(), val.tolist()
    ([1, 2], [-3.0, 2.0])
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from hexagram.compress.base import Layout, Payload
from hexagram.compress.faults import any_of, beyond, clamp_index, out_of_range, unordered
from hexagram.compress.packing import block_size, blocks, cpu_fast

__all__ = ["above", "ascending", "index_dtype", "largest", "pairs_fault", "pairs_layout",
           "scatter"]


def index_dtype(n: int) -> torch.dtype:
    """The wire dtype of indices into ``n`` elements."""
    return torch.int32 if n < 2**31 else torch.int64


def pairs_layout(k: int, n: int, dtype: torch.dtype) -> Layout:
    """A sparsifier's (values, indices) payload of ``k`` of ``n`` elements."""
    return (((k,), dtype), ((k,), index_dtype(n)))


def scatter(payload: Payload, values: Tensor, indices: Tensor, out: Tensor | None = None,
            add: bool = False) -> Tensor:
    """The dense tensor of the (index, value) pairs; written into (``add``: added to) the
    1-D ``out`` if given, which is returned flat. Indices are clamped into range (a
    received payload's may be anything; :func:`pairs_fault` flags those)."""
    if out is None:
        dense = torch.zeros(payload.shape.numel(), dtype=payload.dtype, device=values.device)
        return scatter(payload, values, indices, dense, add=True).view(payload.shape)
    if not add:
        out.zero_()
    # index_add_: duplicate indices (threshold's empty slots at index 0, value 0) are harmless
    return out.index_add_(0, clamp_index(indices, out.numel()), values.to(payload.dtype))


def pairs_fault(values: Tensor, indices: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """0-d bool: the pairs are malformed: a value NaN/Inf (or past ``dtype``'s range), an
    index outside ``[0, n)``, or the indices not strictly increasing (the order every
    sender puts them in, :func:`ascending`): a repeated index would decode to a sum that
    may overflow, or whose rounding depends on the device's order of additions."""
    return any_of([beyond(values, dtype), out_of_range(indices, n), unordered(indices)])


def ascending(indices: Tensor) -> Tensor:
    """The (1-D, distinct) ``indices`` sorted ascending: the order the pair formats send.

    On the CPU numpy's vectorized sort does it: 0.13 against 1.3 ms for torch's sort of
    20K int64 indices, one thread of a Xeon with AVX-512 (2026-11-28). Either way it is one
    sort per payload sent, where checking repeats without the order took one sort per
    payload received.

    Example:
        >>> ascending(torch.tensor([7, 2, 5])).tolist()
        [2, 5, 7]
    """
    if cpu_fast(indices):
        return torch.from_numpy(np.sort(indices.numpy()))
    return torch.sort(indices).values


def above(flat: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """int64 indices and values of the entries with ``|x| >= threshold`` or NaN.

    Found block by block (values are read while the block is in cache), the magnitudes and
    the mask written into two block-sized buffers reused by every block. NaN and Inf are
    always included (``not |x| < t`` holds for NaN), so the caller's check of the selected
    values sees them. float32/float64 tensors on the CPU go through numpy, whose
    ``flatnonzero`` is about 7x faster than ``torch.nonzero`` on a CPU mask: 4.9 against
    11.8 ms for 5M values, one thread, the same indices and values.
    """
    if flat.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=flat.device), flat[:0]
    if cpu_fast(flat) and flat.dtype in (torch.float32, torch.float64):
        return _above_numpy(flat, threshold)
    size = min(flat.numel(), block_size(flat.device))
    magnitude = flat.new_empty(size)
    mask = torch.empty(size, dtype=torch.bool, device=flat.device)
    found, values = [], []
    for start, stop in blocks(flat.numel(), size):
        blk, n = flat[start:stop], stop - start
        torch.abs(blk, out=magnitude[:n])
        local = torch.lt(magnitude[:n], threshold, out=mask[:n]).logical_not_().nonzero()
        local = local.flatten()
        values.append(blk[local])
        found.append(local + start)
    return torch.cat(found), torch.cat(values)


def _above_numpy(flat: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """:func:`above` for a CPU float32/float64 tensor, the scan in numpy (shares memory)."""
    arr = flat.numpy()
    size = min(arr.size, block_size())
    magnitude, keep = np.empty(size, dtype=arr.dtype), np.empty(size, dtype=bool)
    found = []
    for start, stop in blocks(arr.size, size):
        n = stop - start
        np.abs(arr[start:stop], out=magnitude[:n])
        np.less(magnitude[:n], threshold, out=keep[:n])
        found.append(np.flatnonzero(np.logical_not(keep[:n], out=keep[:n])) + start)
    indices = torch.from_numpy(np.concatenate(found))
    return indices, flat[indices]


def largest(candidates: Tensor, values: Tensor, k: int) -> Tensor:
    """The ``k`` candidates (indices) of the largest ``|value|``, in no particular order
    (the caller puts them in the wire's order, :func:`ascending`, and gathers their values
    once)."""
    if candidates.numel() == k:
        return candidates
    return candidates[torch.topk(values.abs(), k, sorted=False).indices]
