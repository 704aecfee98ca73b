"""Byzantine-robust aggregators as pure functions on a stacked ``(n, d)`` tensor.

Row ``i`` is the vector (gradient) sent by rank ``i``; at most ``f`` rows may be arbitrary.
Every aggregator returns one ``(d,)`` vector. Two families:

- coordinate-wise (:func:`median`, :func:`trimmed_mean`): each coordinate on its own, so a
  shard of the coordinates can be aggregated without the rest;
- distance-based (:func:`krum`, :func:`multikrum`, :func:`geomed`, :func:`centered_clip`):
  the result is a linear combination ``c @ x`` whose coefficients ``c`` depend only on the
  Gram matrix ``x @ x.T`` (pairwise distances are ``G_ii + G_jj - 2 G_ij``). The
  ``*_weights`` functions take the Gram matrix, so a distributed caller can allreduce the
  Gram matrix of its shard (``n x n`` numbers) instead of moving whole vectors.

Pre-aggregation (:func:`nnm`, :func:`bucketing`) maps the ``n`` rows to new rows ``W @ x``;
``*_mixing`` returns ``W`` (the Gram matrix of the new rows is ``W G W^T``).

Definitions follow ByzFL (EPFL) so results can be compared bit for bit up to floating point:
median is the mean of the two middle values for even ``n``; Krum's score is the mean of the
``n - f - 1`` smallest squared distances to the other rows; Multi-Krum averages the ``n - f``
lowest scores; the smoothed Weiszfeld starts at zero with weights ``1 / max(||x_i - z||,
nu)``; centered clipping starts at ``center`` (the previous aggregate, i.e. momentum).

Example:
    >>> x = torch.tensor([[1.0, 2.0], [2.0, 3.0], [3.0, 4.0], [100.0, -100.0]])
    >>> median(x)
    tensor([2.5000, 2.5000])
    >>> trimmed_mean(x, f=1)
    tensor([2.5000, 2.5000])
    >>> krum(torch.cat([x[:3], torch.tensor([[2.5, 3.5]]), x[3:]]), f=1)
    tensor([2., 3.])
"""

from __future__ import annotations

import torch
from torch import Tensor

from hexagram.compress.packing import cpu_fast

__all__ = [
    "NETWORK_MAX_ROWS", "bucketing", "bucketing_mixing", "centered_clip",
    "centered_clip_weights", "finite_rows",
    "geomed", "geomed_weights", "gram", "krum", "krum_scores", "krum_weights", "median",
    "multikrum", "multikrum_weights", "nnm", "nnm_mixing", "sort_rows", "squared_distances",
    "trimmed_mean",
]


def _check_f(n: int, f: int, need: int, what: str) -> None:
    if f < 0 or n < need:
        raise ValueError(f"{what} with f={f} needs at least {need} vectors (world size), "
                         f"got {n}; lower f or add ranks")


def finite_rows(x: Tensor) -> Tensor:
    """Boolean ``(n,)``: rows without NaN or Inf (the others are treated as Byzantine).

    A row whose sum is finite holds neither (NaN or Inf would make the sum NaN or Inf), so
    only rows with a non-finite sum (NaN/Inf, or finite values that overflow) are scanned
    element by element: one reduction instead of a boolean copy of ``x`` in the usual case
    (on the CPU's fast path; elsewhere each row's minimum and maximum, with no host read).

    Example:
        >>> finite_rows(torch.tensor([[1.0, 2.0], [3e38, 3e38], [1.0, float("inf")]]))
        tensor([ True,  True, False])
    """
    if x.numel() == 0:
        return torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    if not cpu_fast(x):  # no host read: a row's min and max are finite exactly when its
        return torch.isfinite(x.amin(dim=1)) & torch.isfinite(x.amax(dim=1))  # values are
    ok = torch.isfinite(x.sum(dim=1))
    if not bool(ok.all()):  # the CPU's fast path reads: one reduction in the usual case
        bad = (~ok).nonzero().squeeze(1)
        ok[bad] = torch.isfinite(x[bad]).all(dim=1)
    return ok


# -- coordinate-wise --------------------------------------------------------------------
NETWORK_MAX_ROWS = 24  # sort_rows: a sorting network up to this many rows, torch.sort above


def sort_rows(x: Tensor) -> Tensor:
    """``x.sort(dim=0).values``, the same values, faster for the few rows of a process group.

    ``torch.sort`` along dim 0 sorts ``d`` separate strided columns of ``n`` values, which
    costs about 10x a pass over ``x`` on CPU for ``n`` of 5 to 7. Up to
    :data:`NETWORK_MAX_ROWS` rows, an odd-even transposition network does it instead:
    ``n`` rounds, each one element-wise ``minimum``/``maximum`` over every pair of
    neighbouring rows at once (vectorized over the ``d`` coordinates). Inputs must be free
    of NaN (callers drop non-finite rows first; NaN would not sort as ``torch.sort`` does).

    Example:
        >>> sort_rows(torch.tensor([[3.0, 0.0], [1.0, 2.0], [2.0, 1.0]]))
        tensor([[1., 0.],
                [2., 1.],
                [3., 2.]])
    """
    n = x.shape[0]
    if n > NETWORK_MAX_ROWS:
        return x.sort(dim=0).values
    s = x.clone()
    for r in range(n):
        first = r % 2
        pairs = (n - first) // 2
        if pairs == 0:
            continue
        lo, hi = s[first:first + 2 * pairs:2], s[first + 1:first + 2 * pairs:2]
        low = torch.minimum(lo, hi)
        torch.maximum(lo, hi, out=hi)
        lo.copy_(low)
    return s


def median(x: Tensor) -> Tensor:
    """Coordinate-wise median; mean of the two middle values when ``n`` is even.

    Example:
        >>> median(torch.tensor([[1.0], [5.0], [2.0]]))
        tensor([2.])
    """
    n = x.shape[0]
    s = sort_rows(x)
    if n % 2:
        return s[n // 2]
    return (s[n // 2 - 1] + s[n // 2]) / 2


def trimmed_mean(x: Tensor, f: int) -> Tensor:
    """Coordinate-wise mean after dropping the ``f`` smallest and ``f`` largest values.

    Example:
        >>> trimmed_mean(torch.tensor([[0.0], [1.0], [2.0], [9.0]]), f=1)
        tensor([1.5000])
    """
    n = x.shape[0]
    _check_f(n, f, 2 * f + 1, "trimmed_mean")
    if f == 0:
        return x.mean(dim=0)
    return sort_rows(x)[f:n - f].mean(dim=0)


# -- Gram-matrix helpers ----------------------------------------------------------------
def gram(x: Tensor) -> Tensor:
    """``x @ x.T`` in float64 (distances from it lose less to cancellation)."""
    x64 = x.double()
    return x64 @ x64.T


def squared_distances(g: Tensor) -> Tensor:
    """Pairwise squared distances ``(n, n)`` from a Gram matrix, clamped at 0."""
    d = g.diagonal()
    return (d[:, None] + d[None, :] - 2 * g).clamp_(min=0)


def _combine(c: Tensor, x: Tensor) -> Tensor:
    return (c.to(torch.float64) @ x.double()).to(x.dtype)


# -- distance-based ---------------------------------------------------------------------
def krum_scores(g: Tensor, f: int) -> Tensor:
    """Krum's score of every row: mean squared distance to its ``n - f - 1`` nearest
    other rows (Blanchard et al. 2017)."""
    n = g.shape[0]
    _check_f(n, f, 2 * f + 3, "krum")
    dist = squared_distances(g).sort(dim=1).values[:, 1:n - f]  # column 0: itself
    return dist.mean(dim=1)


def krum_weights(g: Tensor, f: int) -> Tensor:
    """One-hot ``(n,)`` on the row with the lowest Krum score (first on a tie)."""
    scores = krum_scores(g, f)
    c = torch.zeros_like(scores)
    c[int(scores.argmin())] = 1.0
    return c


def multikrum_weights(g: Tensor, f: int, m: int | None = None) -> Tensor:
    """Weights ``1/m`` on the ``m`` (default ``n - f``) rows with the lowest Krum scores."""
    scores = krum_scores(g, f)
    m = g.shape[0] - f if m is None else m
    c = torch.zeros_like(scores)
    c[scores.argsort(stable=True)[:m]] = 1.0 / m
    return c


def _row_distances(g: Tensor, c: Tensor) -> Tensor:
    """``||x_i - c @ x||`` for every row, from the Gram matrix only."""
    gc = g @ c
    return (g.diagonal() - 2 * gc + c @ gc).clamp(min=0).sqrt()


def geomed_weights(g: Tensor, iters: int = 3, nu: float = 0.1) -> Tensor:
    """Smoothed Weiszfeld (``iters`` steps from zero): coefficients of the approximate
    geometric median ``c @ x``."""
    c = torch.zeros(g.shape[0], dtype=g.dtype, device=g.device)
    for _ in range(iters):
        beta = 1.0 / _row_distances(g, c).clamp(min=nu)
        c = beta / beta.sum()
    return c


def centered_clip_weights(g: Tensor, tau: float, iters: int = 1) -> Tensor:
    """Centered clipping (Karimireddy et al. 2021) where the **last** row of the Gram
    matrix is the center (previous aggregate) and the other ``n`` rows are the inputs:
    ``v <- v + mean_i (x_i - v) min(1, tau / ||x_i - v||)``, ``iters`` times. Returns
    ``n + 1`` coefficients (the last one on the center)."""
    k = g.shape[0] - 1
    c = torch.zeros(k + 1, dtype=g.dtype, device=g.device)
    c[k] = 1.0
    for _ in range(iters):
        scale = (tau / _row_distances(g, c)[:k].clamp(min=1e-300)).clamp(max=1.0)
        step = -c * scale.sum()
        step[:k] += scale
        c = c + step / k
    return c


def krum(x: Tensor, f: int) -> Tensor:
    """The row with the lowest Krum score. Needs ``n >= 2f + 3``."""
    return _combine(krum_weights(gram(x), f), x)


def multikrum(x: Tensor, f: int, m: int | None = None) -> Tensor:
    """Mean of the ``m`` (default ``n - f``) rows with the lowest Krum scores."""
    return _combine(multikrum_weights(gram(x), f, m), x)


def geomed(x: Tensor, iters: int = 3, nu: float = 0.1) -> Tensor:
    """Approximate geometric median by ``iters`` smoothed Weiszfeld steps from zero."""
    return _combine(geomed_weights(gram(x), iters, nu), x)


def centered_clip(x: Tensor, tau: float = 10.0, iters: int = 1,
                  center: Tensor | None = None) -> Tensor:
    """Centered clipping around ``center`` (default zero; pass the previous aggregate)."""
    c0 = x.new_zeros(x.shape[1]) if center is None else center
    xa = torch.cat([x, c0[None]])
    return _combine(centered_clip_weights(gram(xa), tau, iters), xa)


# -- pre-aggregation ------------------------------------------------------------------------
def nnm_mixing(g: Tensor, f: int) -> Tensor:
    """Nearest-neighbour mixing (Allouah et al. 2023): row ``i`` of ``W`` averages the
    ``n - f`` rows nearest to ``x_i`` (itself included)."""
    n = g.shape[0]
    if not 0 <= f < n:
        raise ValueError(f"nnm with f={f} needs more than f vectors, got {n}")
    near = squared_distances(g).argsort(dim=1, stable=True)[:, :n - f]
    w = torch.zeros(n, n, dtype=g.dtype, device=g.device)
    w.scatter_(1, near, 1.0 / (n - f))
    return w


def bucketing_mixing(n: int, s: int, generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float64,
                     device: torch.device | str | None = None) -> Tensor:
    """Bucketing (Karimireddy et al. 2022): shuffle the ``n`` rows, average buckets of
    ``s`` (the last one may be smaller). ``W`` is ``(ceil(n / s), n)``, on ``device``
    (default: the generator's, else the CPU); the permutation is drawn where the
    generator lives."""
    if s < 1:
        raise ValueError(f"bucketing needs a bucket size s >= 1, got {s}")
    drawn_on = generator.device if generator is not None else torch.device("cpu")
    device = drawn_on if device is None else torch.device(device)
    perm = torch.randperm(n, generator=generator, device=drawn_on).to(device)
    rows = -(-n // s)
    w = torch.zeros(rows, n, dtype=dtype, device=device)
    for b in range(rows):
        members = perm[b * s:(b + 1) * s]
        w[b, members] = 1.0 / len(members)
    return w


def nnm(x: Tensor, f: int) -> Tensor:
    """:func:`nnm_mixing` applied: ``(n, d)`` mixed rows."""
    return _combine(nnm_mixing(gram(x), f), x)


def bucketing(x: Tensor, s: int, generator: torch.Generator | None = None) -> Tensor:
    """:func:`bucketing_mixing` applied: ``(ceil(n / s), d)`` bucket means."""
    return _combine(bucketing_mixing(x.shape[0], s, generator, device=x.device), x)
