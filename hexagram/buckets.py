"""Buckets: several tensors fused into one contiguous flat buffer, communicated as one.

The engine builds buckets of gradients (or weights, for weight-based algorithms) per dtype
and device; algorithms receive a :class:`Bucket` in ``bucket_ready`` and may read
``bucket.flat`` (1-D, ``bucket.numel`` elements) and ``bucket.entries`` (which parameter sits
at which offset). State an algorithm keeps across steps should be keyed by parameter name
(``entry.name``), not by bucket index: buckets are re-formed after the first step in the
order gradients actually became ready.

Example:
    >>> import torch
    >>> ps = [("a", torch.nn.Parameter(torch.ones(3))), ("b", torch.nn.Parameter(torch.ones(2)))]
    >>> [b.names for b in build_buckets(ps, bucket_bytes=8, first_bucket_bytes=8)]
    [['a'], ['b']]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Bucket", "BucketEntry", "build_buckets", "group_tensors"]


@dataclass(frozen=True)
class BucketEntry:
    """One tensor's place in a bucket: ``flat[offset : offset + numel].view(shape)``."""

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


class Bucket:
    """A flat buffer over several same-dtype tensors.

    Attributes:
        index: position in launch order (bucket 0 is communicated first).
        entries: the tensors it holds, in buffer order.
        flat: the 1-D buffer.
    """

    def __init__(self, index: int, params: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        if not params:
            raise ValueError("a bucket needs at least one tensor")
        first = params[0][1]
        entries, offset = [], 0
        for name, p in params:
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError(f"bucket mixes {p.dtype}/{p.device} ({name}) with "
                                 f"{first.dtype}/{first.device}; buckets are per dtype and device")
            entries.append(BucketEntry(name, p, offset, p.numel(), p.shape))
            offset += p.numel()
        self.index = index
        self.entries: list[BucketEntry] = entries
        self.flat: Tensor = torch.zeros(offset, dtype=first.dtype, device=first.device)
        self.pending = len(entries)
        # one view per entry, made once: gradients may *be* these views (grad_as_view)
        self._views: dict[str, Tensor] = {e.name: self.view(e) for e in entries}

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def over(self, flat: Tensor) -> Bucket:
        """The same entries (index, names, offsets, shapes) over another 1-D buffer of the
        same length, e.g. a 16-bit copy that a wrapper hands to the algorithm it wraps; the
        new bucket never holds parameters' gradients (``holds_grad`` is False).

        >>> b = build_buckets([("w", torch.nn.Parameter(torch.ones(2)))], 8)[0]
        >>> b.over(b.flat.half()).dtype
        torch.float16
        """
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(f"a bucket over another buffer needs a 1-D tensor of {self.numel} "
                             f"elements, got shape {tuple(flat.shape)}")
        other = object.__new__(Bucket)
        other.index, other.entries, other.flat, other.pending = (self.index, self.entries,
                                                                 flat, self.pending)
        other._views = {e.name: other.view(e) for e in self.entries}
        return other

    def view(self, entry: BucketEntry, flat: Tensor | None = None) -> Tensor:
        """The slice of ``flat`` (default: this bucket's buffer) holding ``entry``."""
        buf = self.flat if flat is None else flat
        return buf[entry.offset : entry.offset + entry.numel].view(entry.shape)

    def holds_grad(self, entry: BucketEntry) -> bool:
        """True when ``entry``'s ``.grad`` is this bucket's view of it (no copy needed)."""
        grad, view = entry.param.grad, self._views[entry.name]
        return grad is not None and grad.data_ptr() == view.data_ptr() \
            and grad.shape == view.shape and grad.dtype == view.dtype

    def copy_in_grad(self, entry: BucketEntry, as_view: bool = False) -> None:
        """Copy ``entry``'s gradient (or zeros if it has none) into the buffer; with
        ``as_view`` the gradient becomes the buffer's view (the copy is then the last one:
        results land in ``.grad`` without copying out, and the next accumulation writes
        straight into the buffer)."""
        grad, view = entry.param.grad, self._views[entry.name]
        if grad is None:
            view.zero_()
        elif not self.holds_grad(entry):
            view.copy_(grad)
        if as_view and grad is not None:
            entry.param.grad = view

    def release_grad(self, entry: BucketEntry) -> None:
        """If ``entry``'s ``.grad`` is this bucket's view, give it its own copy (the buffer
        is about to hold something else, e.g. zeros for a parameter unused this step)."""
        if self.holds_grad(entry):
            entry.param.grad = self._views[entry.name].clone()

    def attach_grads(self, skip: frozenset[str] = frozenset()) -> None:
        """Make every entry's ``.grad`` (except ``skip``) this buffer's view of it."""
        for e in self.entries:
            if e.name not in skip and not self.holds_grad(e):
                e.param.grad = self._views[e.name]

    def copy_out_grads(self, flat: Tensor, skip: frozenset[str] = frozenset()) -> None:
        """Write ``flat`` (same layout as the buffer) into each parameter's ``.grad``."""
        for e in self.entries:
            if e.name in skip:
                continue
            src = self.view(e, flat)
            if e.param.grad is None:
                e.param.grad = src.clone()
            else:
                e.param.grad.copy_(src)

    def copy_in_weights(self) -> None:
        """Copy the parameters' current values into the buffer."""
        with torch.no_grad():
            for e in self.entries:
                self.view(e).copy_(e.param)

    def copy_out_weights(self, flat: Tensor | None = None) -> None:
        """Write ``flat`` (default: the buffer) into the parameters."""
        with torch.no_grad():
            for e in self.entries:
                e.param.copy_(self.view(e, flat))

    def __repr__(self) -> str:
        return f"Bucket(index={self.index}, tensors={len(self.entries)}, numel={self.numel})"


def group_tensors(tensors: Sequence[Tensor], bucket_bytes: int,
                  first_bucket_bytes: int | None = None) -> list[list[int]]:
    """Indices of ``tensors`` (in launch order) grouped per dtype/device, the groups in the
    order they close: a group is closed once it holds at least its byte cap (a tensor bigger
    than the cap gets a group of its own), the ones still open follow at the end;
    ``bucket_bytes == 0`` gives one tensor per group. The first group closes at
    ``first_bucket_bytes`` (small, so communication starts early in backward, as DDP does).

    Example:
        >>> group_tensors([torch.zeros(3), torch.zeros(3, dtype=torch.int8), torch.zeros(3)], 20)
        [[0, 2], [1]]
    """
    if bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
    first_cap = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
    open_: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    groups: list[list[int]] = []
    for k, t in enumerate(tensors):
        key = (t.dtype, t.device)
        open_.setdefault(key, []).append(k)
        sizes[key] = sizes.get(key, 0) + t.numel() * t.element_size()
        cap = first_cap if not groups else bucket_bytes
        if sizes[key] >= cap:
            groups.append(open_.pop(key))
            sizes.pop(key)
    return groups + [g for g in open_.values() if g]


def build_buckets(params: Sequence[tuple[str, torch.nn.Parameter]], bucket_bytes: int,
                  first_bucket_bytes: int | None = None) -> list[Bucket]:
    """Group ``params`` (in launch order) into buckets per dtype/device
    (:func:`group_tensors`: a bucket closes at its byte cap, the first at
    ``first_bucket_bytes``; ``bucket_bytes == 0`` gives one tensor per bucket)."""
    groups = group_tensors([p for _, p in params], bucket_bytes, first_bucket_bytes)
    return [Bucket(i, [params[k] for k in g]) for i, g in enumerate(groups)]
