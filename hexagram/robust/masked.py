"""Distance-based aggregators and pre-aggregation over rows some of which are excluded, with
no host read: fixed shapes, the excluded rows masked on the device.

:mod:`hexagram.robust.shard_reduce` treats a row holding NaN or Inf as Byzantine: it is
dropped and ``f`` is lowered by the number dropped. Selecting the finite rows would size
every later tensor by data (a ``nonzero`` and a host read per bucket on a GPU), so these
functions keep all ``n`` rows and take ``ok`` (``(n,)`` bool, the rows kept) instead: an
excluded row is at distance +Inf from every other row (Krum never counts it among a row's
nearest, its own score is +Inf; NNM never picks it as a neighbour) and has weight 0
(geometric median, centered clipping, bucket means). Counts that depend on how many rows
are kept (Krum's neighbours, Multi-Krum's selection, NNM's neighbours, the means'
denominators) are 0-d tensors on the device and select by position masks.

Each function returns what its counterpart in :mod:`hexagram.robust.aggregators` returns
on the kept rows alone (coefficients over all ``n`` rows, zero on the excluded ones), up to
the order of float sums; with every row kept the same coefficients (Krum's one-hot exactly).
The coefficients, the Gram matrix and the rows they combine must be finite: callers zero
the excluded rows of both (``0 * NaN`` is NaN).

Example:
    >>> import torch
    >>> from hexagram.robust import aggregators as agg
    >>> x = torch.tensor([[1.1], [1.0], [0.9], [1.0], [9.0], [0.0]])
    >>> ok = torch.tensor([True, True, True, True, True, False])  # the last one was NaN
    >>> krum_weights(agg.gram(x), ok, torch.tensor(1)).tolist()
    [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import torch
from torch import Tensor

from hexagram.robust.aggregators import _row_distances, squared_distances

__all__ = ["bucketing_mixing", "centered_clip_weights", "geomed_weights", "krum_scores",
           "krum_weights", "lowered", "multikrum_weights", "nnm_mixing"]

_TINY = torch.finfo(torch.float64).tiny


def lowered(f: int, ok: Tensor) -> Tensor:
    """``f`` less the rows not kept, at least 0 (0-d, on ``ok``'s device): a detected
    attacker no longer needs to be outvoted."""
    return torch.clamp(f - (ok.numel() - ok.sum()), min=0)


def _far(g: Tensor, ok: Tensor) -> Tensor:
    """Squared distances with +Inf wherever either row is not kept."""
    pair = ok[:, None] & ok[None, :]
    return torch.where(pair, squared_distances(g), float("inf"))


def krum_scores(g: Tensor, ok: Tensor, f: Tensor) -> Tensor:
    """Krum's score of every kept row (mean squared distance to its ``kept - f - 1``
    nearest other kept rows); +Inf on the rows not kept. ``f`` is 0-d, at most
    ``(kept - 3) // 2``."""
    n = g.shape[0]
    s = _far(g, ok).sort(dim=1).values  # column 0: the row itself (distance 0)
    m = ok.sum() - f - 1
    pos = torch.arange(n, device=g.device)
    near = (pos >= 1) & (pos <= m)
    total = torch.where(near[None, :], s, 0.0).sum(dim=1)
    return torch.where(ok, total / m.clamp(min=1), float("inf"))


def krum_weights(g: Tensor, ok: Tensor, f: Tensor) -> Tensor:
    """One-hot ``(n,)`` on the kept row with the lowest Krum score (first on a tie)."""
    scores = krum_scores(g, ok, f)
    pos = torch.arange(g.shape[0], device=g.device)
    return (pos == scores.argmin()).to(g.dtype)


def multikrum_weights(g: Tensor, ok: Tensor, f: Tensor) -> Tensor:
    """Weights ``1 / m`` on the ``m = kept - f`` kept rows with the lowest Krum scores."""
    scores = krum_scores(g, ok, f)
    n = g.shape[0]
    m = (ok.sum() - f).clamp(min=1)
    pos = torch.arange(n, device=g.device)
    vals = torch.where(pos < m, 1.0 / m.to(g.dtype), 0.0).to(g.dtype)
    order = scores.argsort(stable=True)  # the rows not kept (+Inf) last
    return torch.zeros(n, dtype=g.dtype, device=g.device).scatter(0, order, vals)


def geomed_weights(g: Tensor, ok: Tensor, iters: int = 3, nu: float = 0.1) -> Tensor:
    """Smoothed Weiszfeld from zero over the kept rows (weight 0 on the others)."""
    w = ok.to(g.dtype)
    c = torch.zeros(g.shape[0], dtype=g.dtype, device=g.device)
    for _ in range(iters):
        beta = w / _row_distances(g, c).clamp(min=nu)
        c = beta / beta.sum().clamp(min=_TINY)  # no row kept: zeros, not 0/0
    return c


def centered_clip_weights(g: Tensor, ok: Tensor, tau: float, iters: int = 1) -> Tensor:
    """Centered clipping over the kept rows; the **last** row of ``g`` is the center and
    ``ok`` covers the others. ``n + 1`` coefficients, the last one on the center."""
    k = g.shape[0] - 1
    w = ok.to(g.dtype)
    kept = ok.sum().clamp(min=1).to(g.dtype)
    c = torch.zeros(k + 1, dtype=g.dtype, device=g.device)
    c[k] = 1.0
    for _ in range(iters):
        scale = w * (tau / _row_distances(g, c)[:k].clamp(min=1e-300)).clamp(max=1.0)
        step = -c * scale.sum()
        step[:k] += scale
        c = c + step / kept
    return c


def nnm_mixing(g: Tensor, ok: Tensor, f: Tensor) -> Tensor:
    """NNM over the kept rows: row ``i`` of ``W`` (``i`` kept) averages the ``kept - f``
    kept rows nearest to ``x_i``; rows not kept are zero (and stay excluded)."""
    n = g.shape[0]
    near = _far(g, ok).argsort(dim=1, stable=True)  # the rows not kept last
    m = (ok.sum() - f).clamp(min=1)
    pos = torch.arange(n, device=g.device)
    vals = torch.where(pos < m, 1.0 / m.to(g.dtype), 0.0).to(g.dtype).expand(n, n)
    w = torch.zeros(n, n, dtype=g.dtype, device=g.device).scatter(1, near, vals)
    return torch.where(ok[:, None], w, 0.0)


def bucketing_mixing(w: Tensor, ok: Tensor) -> tuple[Tensor, Tensor]:
    """Bucket means over the kept rows: ``w`` is
    :func:`hexagram.robust.aggregators.bucketing_mixing`'s ``(buckets, n)`` matrix; each
    bucket averages its kept members. Returns the new ``W`` and which buckets hold any
    kept row (an empty bucket is excluded like a non-finite row)."""
    member = (w > 0) & ok[None, :]
    count = member.sum(dim=1)
    return member.to(w.dtype) / count.clamp(min=1).to(w.dtype)[:, None], count > 0
