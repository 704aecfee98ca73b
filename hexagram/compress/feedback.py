"""Error feedback (Seide et al. 2014; Karimireddy et al. 2019) as a wrapper of any compressor.

What compression drops is kept in a residual and added to the next input, so biased
compressors (top-k, sign, PowerSGD) converge like SGD. One wrapper serves many tensors: each
residual is stored under a key (a parameter or bucket name). The invariant, for every key:

    sent + new residual == gradient + old residual

The few operations algorithms need:

- ``payload = ef.compress(key, grad)``: compress ``grad + residual`` and keep what the
  payload does not carry (``compressor.decompress(payload)``) as the new residual.
- ``ef.correct_(key, buf)`` (``buf += residual``, in the caller's buffer), then one of
  ``ef.update_from(key, buf, payload)`` (what the payload carries was sent),
  ``ef.update_selected(key, buf, indices)`` (those entries were sent) or
  ``ef.update(key, buf, sent)`` (the dense tensor actually counted: gTop-k's global
  selection, PowerSGD's averaged P Q^T); ``ef.residual_buffer(key, like)`` for a caller
  that writes the residual itself.
- ``ef.compress_flat(layout, keys, lengths, flat, segments)``: the same for all the tensors
  of a bucket at once, their residuals views of one buffer per bucket layout
  (:meth:`ErrorFeedback.bind_flat`): a few ops per bucket instead of a few per tensor.

Residuals keep the gradient's dtype and shape; :meth:`ErrorFeedback.state_dict` holds them
(and the inner compressor's state) for checkpoints.

Example:
    >>> import torch, hexagram.compress as hc
    >>> ef = hc.ErrorFeedback(hc.get("topk", k=1))
    >>> g = torch.tensor([3.0, 1.0, -2.0])
    >>> ef.compressor.decompress(ef.compress("w", g)).tolist(), ef.residual("w").tolist()
    ([3.0, 0.0, 0.0], [0.0, 1.0, -2.0])
    >>> ef.compressor.decompress(ef.compress("w", g)).tolist()   # corrected: [3, 2, -4]
    [0.0, 0.0, -4.0]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from hexagram.compress.base import Compressor, Payload
from hexagram.compress.segments import Segments
from hexagram.compress.sparsify import TopKCompressor

__all__ = ["ErrorFeedback", "subtract_pairs"]


class ErrorFeedback:
    """Keyed residuals around ``compressor`` (see the module docstring)."""

    def __init__(self, compressor: Compressor) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"ErrorFeedback wraps a Compressor, got {type(compressor).__name__}")
        self.compressor = compressor
        self._residuals: dict[Hashable, Tensor] = {}
        #: layout -> one buffer whose views are the residuals of its keys (see bind_flat)
        self._flat: dict[Hashable, _FlatResidual] = {}
        self._owner: dict[Hashable, _FlatResidual] = {}  # key -> the binding holding it

    def residual(self, key: Hashable) -> Tensor | None:
        """The residual of ``key`` (None before its first update)."""
        return self._residuals.get(key)

    def correct_(self, key: Hashable, grad: Tensor) -> Tensor:
        """``grad += residual[key]`` in place (for a caller that owns ``grad``); returns it.

        ``grad`` is the caller's buffer (a bucket view): no tensor as large as it is made.
        """
        residual = self._residuals.get(key)
        if residual is None:
            return grad
        self._check(key, residual, grad)
        return grad.add_(residual)

    def residual_buffer(self, key: Hashable, like: Tensor) -> Tensor:
        """Memory for ``key``'s next residual, shaped like ``like``, for a caller that
        computes the residual itself (PowerSGD writes ``M - P Q^T`` there directly).

        The old residual's memory when it fits (its values are overwritten by the caller),
        else a new tensor, registered as ``key``'s residual either way. Whatever the caller
        writes into it is the residual the next step adds.
        """
        residual = self._residuals.get(key)
        if residual is None or residual.shape != like.shape or residual.dtype != like.dtype:
            residual = torch.empty_like(like)
            self._store(key, residual)
        return residual

    def update_from(self, key: Hashable, corrected: Tensor, payload: Payload) -> None:
        """Residual of ``key`` := ``corrected - decompress(payload)``, decoded into the old
        residual's memory (same values as :meth:`update`, no new tensors)."""
        residual = self._residuals.get(key)
        if residual is None or residual.shape != corrected.shape \
                or residual.dtype != corrected.dtype:
            residual = torch.empty_like(corrected)
        flat, src = residual.view(-1), corrected.detach().reshape(-1)
        if isinstance(self.compressor, TopKCompressor):
            subtract_pairs(payload, src, flat)
        else:
            self.compressor.decompress_into(payload, flat)
            torch.sub(src, flat, out=flat)
        self._store(key, residual)

    def update_selected(self, key: Hashable, corrected: Tensor, sent: Tensor) -> None:
        """Residual of ``key`` := ``corrected`` with the (1-D) indices ``sent`` zeroed: what
        :meth:`update` keeps when exactly those entries of ``corrected`` were counted
        (sparsifiers), in the old residual's memory."""
        residual = self._residuals.get(key)
        if residual is None or residual.shape != corrected.shape \
                or residual.dtype != corrected.dtype:
            residual = torch.empty_like(corrected)
        residual.copy_(corrected.detach()).view(-1).index_fill_(0, sent, 0.0)
        self._store(key, residual)

    # -- one buffer per bucket layout: the hot path of layer-wise error feedback ----------
    def bind_flat(self, layout: Hashable, keys: Sequence[Hashable], lengths: Sequence[int],
                  like: Tensor) -> _FlatResidual:
        """One 1-D buffer (``like``'s dtype and device, ``sum(lengths)`` elements) whose
        consecutive views are the residuals of ``keys`` (1-D, ``lengths`` elements each).

        Built on the first call for ``layout`` (a key the caller keeps for one bucket
        layout) and reused while every residual it holds is still its view: the residuals
        found under ``keys`` are copied in (zeros where none), and from then on
        ``corrected = flat + residual`` and ``residual = corrected - sent`` are one op for
        the whole bucket instead of one per tensor. The per-key residuals stay what
        :meth:`residual` and :meth:`state_dict` see, so they survive a new bucket layout
        (which binds them into its own buffer) and checkpoints. A residual stored by any
        other method (or reset, or loaded) unbinds its buffer, rebuilt at its next use.

        Raises ValueError when a residual found under a key has another size or dtype.
        """
        bound = self._flat.get(layout)
        if bound is not None and bound.valid and bound.buffer.dtype == like.dtype \
                and bound.buffer.device == like.device:
            return bound
        buffer = torch.zeros(sum(lengths), dtype=like.dtype, device=like.device)
        bound = _FlatResidual(buffer, tuple(keys))
        start = 0
        for key, n in zip(keys, lengths):
            view = buffer[start:start + n]
            old = self._residuals.get(key)
            if old is not None:
                self._check(key, old.reshape(-1), view)
                view.copy_(old.reshape(-1))
                bound.zero = False
            self._unbind(key)
            self._residuals[key], self._owner[key] = view, bound
            start += n
        self._flat[layout] = bound
        return bound

    def compress_flat(self, layout: Hashable, keys: Sequence[Hashable],
                      lengths: Sequence[int], flat: Tensor, segments: Segments | None = None,
                      generator: torch.Generator | None = None, divisor: int = 1) -> Payload:
        """The payload of ``(flat + residuals) / divisor``, where ``flat`` (1-D, the
        caller's buffer: it receives the residuals in place) lays the tensors of ``keys``
        end to end; their residuals := what the payload does not carry.

        ``segments``: compress per tensor in one call (``compress_segments``); ``None``:
        ``flat`` compressed as one tensor. Invariant, per key: ``sent + new residual ==
        tensor + old residual`` with ``sent = divisor * decoded``. A handful of ops per
        call, whatever the number of keys (:meth:`bind_flat`).
        """
        bound = self.bind_flat(layout, keys, lengths, flat)
        res = bound.buffer
        if not bound.zero:  # (a zero residual is not added: -0.0 stays -0.0, as alone)
            flat.add_(res)
        c = self.compressor
        work = flat / divisor if divisor > 1 else flat
        payload = c.compress(work, generator) if segments is None \
            else c.compress_segments(work, segments, generator)
        if divisor == 1 and isinstance(c, TopKCompressor):
            subtract_pairs(payload, flat, res)
        else:
            if segments is None:
                c.decompress_into(payload, res)
            else:
                c.decompress_segments_into(payload, res)
            torch.sub(flat, res.mul_(divisor) if divisor > 1 else res, out=res)
        bound.zero = False
        return payload

    def _store(self, key: Hashable, residual: Tensor) -> None:
        if self._residuals.get(key) is not residual:
            self._unbind(key)
        self._residuals[key] = residual

    def _unbind(self, key: Hashable) -> None:
        bound = self._owner.pop(key, None)
        if bound is not None:  # its buffer no longer holds this key's residual
            bound.valid = False
            for layout in [k for k, v in self._flat.items() if v is bound]:
                del self._flat[layout]

    def _unbind_all(self) -> None:
        for bound in self._flat.values():
            bound.valid = False
        self._flat.clear()
        self._owner.clear()

    @staticmethod
    def _check(key: Hashable, residual: Tensor, grad: Tensor) -> None:
        if residual.shape != grad.shape or residual.dtype != grad.dtype:
            raise ValueError(
                f"error feedback key {key!r}: residual is {tuple(residual.shape)} "
                f"{residual.dtype} but the tensor is {tuple(grad.shape)} {grad.dtype}; use "
                "one key per tensor (or reset(key) after changing it)"
            )

    def update(self, key: Hashable, corrected: Tensor, sent: Tensor) -> None:
        """Residual of ``key`` := ``corrected - sent`` (``sent``: the dense tensor counted),
        written into the old residual's memory when it fits (neither argument may be it)."""
        if sent.shape != corrected.shape:
            raise ValueError(f"error feedback key {key!r}: sent has shape {tuple(sent.shape)}, "
                             f"corrected {tuple(corrected.shape)}")
        residual = self._residuals.get(key)
        if residual is None or residual.shape != corrected.shape \
                or residual.dtype != corrected.dtype:
            self._store(key, corrected.detach() - sent.detach().to(corrected.dtype))
            return
        torch.sub(corrected.detach(), sent.detach().to(corrected.dtype), out=residual)

    def compress(self, key: Hashable, grad: Tensor,
                 generator: torch.Generator | None = None) -> Payload:
        """Compress ``grad + residual[key]``; the part the payload does not carry stays
        (``grad`` is not modified). Decode with the inner ``compressor``."""
        corrected = self.correct_(key, grad.detach().clone())
        payload = self.compressor.compress(corrected, generator)
        self.update_from(key, corrected, payload)
        return payload

    def reset(self, key: Hashable | None = None) -> None:
        """Drop the residual of ``key`` (all residuals when None)."""
        if key is None:
            self._residuals.clear()
            self._unbind_all()
        else:
            self._residuals.pop(key, None)
            self._unbind(key)

    def state_dict(self) -> dict[str, Any]:
        """Residuals (copied) and the inner compressor's state."""
        return {"residuals": {k: v.clone() for k, v in self._residuals.items()},
                "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self._unbind_all()
        self.compressor.load_state_dict(state["compressor"])

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.compressor!r}, keys={len(self._residuals)})"


class _FlatResidual:
    """A buffer whose views are the residuals of ``keys`` (see :meth:`ErrorFeedback.bind_flat`)."""

    def __init__(self, buffer: Tensor, keys: tuple[Hashable, ...]) -> None:
        self.buffer = buffer
        self.keys = keys
        self.valid = True  # False once a residual of its keys lives elsewhere
        self.zero = True  # nothing added yet: every residual is zero


def subtract_pairs(payload: Payload, src: Tensor, out: Tensor) -> Tensor:
    """``out`` (1-D) := ``src - decompress(payload)`` for a top-k payload (distinct
    indices), in two passes instead of three: ``src`` copied, then each sent value
    subtracted at its index. Bit-identical to decoding into ``out`` (zeros, then
    ``0.0 + v`` at each index) and subtracting: the values get the same ``+ 0.0`` (it
    turns -0.0 into +0.0, as adding to the zeroed buffer does). Returns ``out``.

    Example:
        >>> import hexagram.compress as hc
        >>> c, x = hc.get("topk", k=1), torch.tensor([3.0, 1.0, -2.0])
        >>> subtract_pairs(c.compress(x), x, torch.empty(3)).tolist()
        [0.0, 1.0, -2.0]
    """
    values, indices = payload.tensors
    out.copy_(src)
    return out.index_add_(0, indices, values.to(payload.dtype) + 0.0, alpha=-1)
