"""Weights of many tensors in one flat buffer: the outer step of the DiLoCo family.

An outer step reads every parameter, forms ``anchor - x``, updates per-tensor state
(momentum, error feedback) and writes the new weights back. Done tensor by tensor that is
a dozen kernels per tensor; here the parameters of one dtype and device are laid out once
in a flat buffer (:class:`FlatWeights`: the offsets are fixed at set-up, optionally padded,
e.g. to whole chunks for :class:`~hexagram.compress.chunk_rows.ChunkRows`), every state
tensor is such a buffer (:class:`Flat`: the buffer and its per-tensor views, made once),
and a step costs one ``_foreach_copy_`` to read the weights, one to write them and a few
element-wise kernels over the whole buffer, however many tensors the model has.

Padding (where offsets leave gaps) holds zeros in every buffer; it is never written to a
parameter and never saved.

Example:
    >>> import torch
    >>> w = [("a", torch.nn.Parameter(torch.ones(2))), ("b", torch.nn.Parameter(torch.ones(3)))]
    >>> fw = FlatWeights(w, offsets=(0, 4), numel=7)
    >>> fw.read(fw.new()).tolist()
    [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hexagram.buckets import BucketEntry
from hexagram.errors import ConfigError

__all__ = ["Flat", "FlatWeights", "Named", "by_dtype_and_device", "named_copies",
           "split_groups"]


@dataclass
class Flat:
    """A flat buffer and its views, one per tensor of a :class:`FlatWeights` (shaped as
    the parameters)."""

    flat: Tensor
    views: list[Tensor]


def by_dtype_and_device(named: Sequence[tuple[str, torch.nn.Parameter]]
                        ) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """``named`` split per (dtype, device), in order of first appearance (order kept)."""
    groups: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in named:
        groups.setdefault((p.dtype, p.device), []).append((name, p))
    return list(groups.values())


class FlatWeights:
    """Parameters of one dtype and device at fixed offsets of a flat buffer.

    ``offsets`` (default: end to end) and ``numel`` (default: the end of the last tensor)
    place each tensor; ``entries`` describe them as a bucket's entries do (name, parameter,
    offset, numel, shape), so a per-tensor compressor can work on views of the buffer.
    """

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]],
                 offsets: Sequence[int] | None = None, numel: int | None = None) -> None:
        if not named:
            raise ValueError("FlatWeights needs at least one parameter")
        params: list[Tensor] = [p for _, p in named]
        first = params[0]
        if any(p.dtype != first.dtype or p.device != first.device for p in params):
            raise ValueError("FlatWeights holds one dtype and device; split with "
                             "by_dtype_and_device first")
        if offsets is None:
            offsets = [0]
            for p in params[:-1]:
                offsets.append(offsets[-1] + p.numel())
        end = max(o + p.numel() for o, p in zip(offsets, params))
        self.numel = end if numel is None else numel
        self.params = params
        self.dtype, self.device = first.dtype, first.device
        self.entries = [BucketEntry(n, p, o, p.numel(), p.shape)
                        for (n, p), o in zip(named, offsets)]
        self.names = [n for n, _ in named]

    def new(self) -> Flat:
        """A zero buffer of this layout with its views."""
        flat = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return Flat(flat, self.views(flat))

    def views(self, flat: Tensor) -> list[Tensor]:
        """Each parameter's view of ``flat`` (a buffer of this layout), shaped as it."""
        return [flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries]

    def read(self, into: Flat) -> Tensor:
        """Copy the parameters into ``into`` (one ``_foreach_copy_``); returns its buffer."""
        with torch.no_grad():
            torch._foreach_copy_(into.views, self.params)
        return into.flat

    def write(self, src: Flat) -> None:
        """Copy ``src``'s views into the parameters (one ``_foreach_copy_``)."""
        with torch.no_grad():
            torch._foreach_copy_(self.params, src.views)

    def named(self, flat: Tensor) -> dict[str, Tensor]:
        """``{parameter name: copy of its part of flat}`` (what checkpoints hold)."""
        return {n: v.clone() for n, v in zip(self.names, self.views(flat))}

    def load(self, named: dict[str, Tensor], what: str) -> Flat:
        """Inverse of :meth:`named`: a new buffer; names a missing parameter clearly."""
        out = self.new()
        for name, view in zip(self.names, out.views):
            if name not in named:
                raise KeyError(f"{what}: checkpoint has no entry for parameter {name!r}; "
                               "was it saved from the same model and algorithm?")
            view.copy_(named[name])
        return out


#: ``(name, parameter)`` pairs, in order
Named = list[tuple[str, torch.nn.Parameter]]


def split_groups(named: Named, parts: int) -> list[Named]:
    """The tensors ``named`` in ``parts`` contiguous groups of similar size."""
    if parts == 1:
        return [named]
    if len(named) < parts:
        raise ConfigError(f"DiLoCoConfig.fragments={parts} but the model has only "
                          f"{len(named)} trainable tensors; use fragments <= {len(named)}")
    total, size = sum(p.numel() for _, p in named), 0
    groups: list[Named] = []
    current: Named = []
    for i, (name, p) in enumerate(named):
        current.append((name, p))
        size += p.numel()
        left_tensors, left_groups = len(named) - i - 1, parts - len(groups) - 1
        if left_groups > 0 and (size * parts >= total * (len(groups) + 1)
                                or left_tensors == left_groups):
            groups.append(current)
            current = []
    groups.append(current)
    return groups


def named_copies(weights: Sequence[FlatWeights], flats: Sequence[Flat | Tensor]
                 ) -> dict[str, Tensor]:
    """Per-parameter copies of one flat buffer per :class:`FlatWeights` (checkpoints)."""
    out: dict[str, Tensor] = {}
    for w, flat in zip(weights, flats):
        out.update(w.named(flat.flat if isinstance(flat, Flat) else flat))
    return out
