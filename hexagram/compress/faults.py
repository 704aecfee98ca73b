"""Device-side checks of received payloads: the building blocks of
:meth:`hexagram.compress.base.Compressor.payload_fault`.

A payload that crossed the wire may hold anything (a corrupted link, a peer running another
version, a hostile peer). Decoders are safe on any bytes (indices clamped into range, codes
in range by construction), and each compressor says, as a 0-d bool tensor on the payload's
device, whether what it decoded is to be trusted. Every function here returns such a flag
(True: malformed) without reading the device, so the caller can join it to the step's one
host read (:class:`hexagram.algorithms.finite.StepChecks`).

Example:
    >>> import torch
    >>> bool(beyond(torch.tensor([1.0, float("nan")]), torch.float32))
    True
    >>> bool(out_of_range(torch.tensor([0, 3], dtype=torch.int32), 4))
    False
    >>> bool(unordered(torch.tensor([0, 2, 2])))
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["any_of", "beyond", "clamp_index", "no_fault", "out_of_range", "row_positions",
           "unordered"]


def no_fault(device: torch.device) -> Tensor:
    """A 0-d False on ``device`` (a payload with nothing to check)."""
    return torch.zeros((), dtype=torch.bool, device=device)


def beyond(values: Tensor, dtype: torch.dtype, factor: float = 1.0) -> Tensor:
    """0-d bool: some ``factor * |value|`` is NaN, Inf or past ``dtype``'s largest finite
    value (the values would decode to NaN/Inf in ``dtype``). One min-max pass over
    ``values`` (a header, or the values of the pairs: small), compared in float64."""
    if values.numel() == 0:
        return no_fault(values.device)
    ends = torch.stack(torch.aminmax(values.reshape(-1))).double()
    if factor != 1.0:
        ends = ends.mul_(factor)
    limit = torch.finfo(dtype).max
    return ~(ends.abs() <= limit).all()  # NaN compares False


def out_of_range(indices: Tensor, n: int) -> Tensor:
    """0-d bool: some index lies outside ``[0, n)``."""
    if indices.numel() == 0:
        return no_fault(indices.device)
    return ((indices < 0) | (indices >= n)).any()


def unordered(indices: Tensor) -> Tensor:
    """0-d bool: the (1-D) indices are not strictly increasing. The pair formats send their
    indices ascending, so one comparison of neighbours finds a repeat (a sort of every
    received payload cost 1.3 ms for 20K indices on a CPU core; this, 0.07 ms)."""
    if indices.numel() < 2:
        return no_fault(indices.device)
    return (indices[1:] <= indices[:-1]).any()


def clamp_index(indices: Tensor, n: int) -> Tensor:
    """``indices`` clamped into ``[0, n)``: an index read from the wire can then never
    address memory outside the output (on a GPU that is a device-side assert, which kills
    the process and its CUDA context). Valid indices are unchanged; a payload holding an
    invalid one is flagged by its compressor's ``payload_fault``, so its (harmless, wrong)
    result is never used."""
    return indices.clamp(0, max(n - 1, 0))


def any_of(flags: Sequence[Tensor]) -> Tensor:
    """0-d bool: some flag holds (one op for several)."""
    if len(flags) == 1:
        return flags[0]
    return torch.stack([f.reshape(()) for f in flags]).any()


def row_positions(pos: Tensor, width: int) -> Tensor:
    """0-d bool: some of the (rows, k) positions (each row's, distinct in a valid payload:
    a chunk's top-k) is past ``width`` or repeats in its row (one sort along the rows:
    a repeat makes a scatter's result depend on the device's order, so ranks could
    disagree bit for bit)."""
    if pos.numel() == 0:
        return no_fault(pos.device)
    flags = [(pos >= width).any()]
    if pos.shape[-1] > 1:
        ordered = torch.sort(pos, dim=-1).values
        flags.append((ordered[..., 1:] == ordered[..., :-1]).any())
    return any_of(flags)
