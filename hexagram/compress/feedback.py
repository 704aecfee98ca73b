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

from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor

from hexagram.compress.base import Compressor, Payload
from hexagram.compress.sparsify import TopKCompressor

__all__ = ["ErrorFeedback", "subtract_pairs"]


class ErrorFeedback:
    """Keyed residuals around ``compressor`` (see the module docstring)."""

    def __init__(self, compressor: Compressor) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"ErrorFeedback wraps a Compressor, got {type(compressor).__name__}")
        self.compressor = compressor
        self._residuals: dict[Hashable, Tensor] = {}

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
            self._residuals[key] = residual
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
        self._residuals[key] = residual

    def update_selected(self, key: Hashable, corrected: Tensor, sent: Tensor) -> None:
        """Residual of ``key`` := ``corrected`` with the (1-D) indices ``sent`` zeroed: what
        :meth:`update` keeps when exactly those entries of ``corrected`` were counted
        (sparsifiers), in the old residual's memory."""
        residual = self._residuals.get(key)
        if residual is None or residual.shape != corrected.shape \
                or residual.dtype != corrected.dtype:
            residual = torch.empty_like(corrected)
        residual.copy_(corrected.detach()).view(-1).index_fill_(0, sent, 0.0)
        self._residuals[key] = residual

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
            self._residuals[key] = corrected.detach() - sent.detach().to(corrected.dtype)
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
        else:
            self._residuals.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        """Residuals (copied) and the inner compressor's state."""
        return {"residuals": {k: v.clone() for k, v in self._residuals.items()},
                "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.compressor.load_state_dict(state["compressor"])

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.compressor!r}, keys={len(self._residuals)})"


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
