"""One shard's robust reduction: the ``fn`` that :func:`hexagram.comm.shards.shard_map` calls.

Each rank holds the ``(P, m)`` rows of its shard (row ``i`` from rank ``i``). Coordinate-wise
aggregators need nothing else. Distance-based aggregators and pre-aggregation need the
Gram matrix of the *whole* vectors: each rank computes its shard's partial Gram matrix (and
a flag per row that holds NaN/Inf), one allreduce of ``P^2 + P`` numbers sums them, and
every rank then derives the same coefficients and combines its own shard with them.

Rows with NaN or Inf are Byzantine by definition: they are dropped and ``f`` is lowered by
their number (a detected attacker no longer needs to be outvoted). None of it reads the
host: shapes stay fixed and the counts live on the device. Coordinate-wise aggregators sort
dropped rows last (as +Inf) and pick the rows kept by counts (:func:`coordinate_wise`);
distance-based ones and pre-aggregation put dropped rows at +Inf distance or weight 0
(:mod:`hexagram.robust.masked`).

Example:
    >>> import torch
    >>> spec = ReduceSpec(aggregator="median", f=1)
    >>> reduce_rows(torch.tensor([[1.0], [2.0], [float("nan")], [9.0]]), spec)
    tensor([2.])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from hexagram.config import check_float, check_int
from hexagram.errors import ConfigError
from hexagram.robust import aggregators as agg
from hexagram.robust import masked

__all__ = ["AGGREGATORS", "COORDINATE_WISE", "DISTANCE_BASED", "PRE_AGGREGATORS", "ReduceSpec",
           "coordinate_wise", "min_world_size", "reduce_rows"]

COORDINATE_WISE = ("median", "trimmed_mean")
DISTANCE_BASED = ("krum", "multikrum", "geomed", "centered_clip")
PRE_AGGREGATORS = ("nnm", "bucketing")
AGGREGATORS = COORDINATE_WISE + DISTANCE_BASED

Sync = Callable[[Tensor], Tensor]


@dataclass(frozen=True, kw_only=True)
class ReduceSpec:
    """What to compute on a shard; the one definition of the aggregation fields
    (:class:`hexagram.algorithms.robust.RobustConfig` extends it with the algorithm's own).

    Attributes:
        aggregator: one of :data:`AGGREGATORS` (coordinate-wise ones are cheapest).
        f: Byzantine ranks tolerated; higher => more rows discarded, needs more ranks
            (``2f + 1``, Krum/Multi-Krum ``2f + 3``).
        pre: pre-aggregation, ``"nnm"`` or ``"bucketing"`` (helps on non-IID data), or None.
        bucket_size: ranks per bucket for ``pre="bucketing"`` (larger => more averaging,
            fewer effective rows).
        iters: Weiszfeld steps (geomed).
        nu: Weiszfeld smoothing (smallest distance used as a weight's denominator).
        tau: centered clipping radius, in gradient units: about the norm of the honest
            gradients' spread (smaller => an attacker moves the result at most
            ``clip_iters * tau * f / P`` per step, honest changes are followed slower). At
            10 (norms about 1) a x -10 attacker was not clipped and training diverged.
        clip_iters: clipping steps (centered_clip; 1 as in ByzFL).

    Example:
        >>> ReduceSpec(aggregator="krum", f=2).rows_for(7)
        7
    """

    aggregator: str = "trimmed_mean"
    f: int = 1
    pre: str | None = None
    bucket_size: int = 2
    iters: int = 3
    nu: float = 0.1
    tau: float = 1.0
    clip_iters: int = 1

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.aggregator not in AGGREGATORS:
            raise ConfigError(f"{name}.aggregator {self.aggregator!r} is unknown; valid "
                              f"aggregators: {', '.join(AGGREGATORS)}")
        if self.pre is not None and self.pre not in PRE_AGGREGATORS:
            raise ConfigError(f"{name}.pre {self.pre!r} is unknown; valid: None, "
                              f"{', '.join(PRE_AGGREGATORS)}")
        check_int(self, "f", low=0)
        check_int(self, "bucket_size", low=1)
        check_int(self, "iters", low=1)
        check_int(self, "clip_iters", low=1)
        check_float(self, "nu", low=0.0, low_open=True)
        check_float(self, "tau", low=0.0, low_open=True)

    def rows_for(self, world_size: int) -> int:
        """Rows the aggregator sees from ``world_size`` ranks (bucketing: one per bucket)."""
        if self.pre == "bucketing":  # each bucket may hold an attacker: fewer, mixed rows
            return -(-world_size // self.bucket_size)
        return world_size

    def check_world_size(self, world_size: int) -> None:
        """Raise :class:`ConfigError` when ``world_size`` ranks cannot tolerate ``f``."""
        rows = self.rows_for(world_size)
        need = min_world_size(self.aggregator, self.f)
        if rows < need:
            limit = "2f + 3" if self.aggregator in ("krum", "multikrum") else "2f + 1"
            what = f"{rows} buckets of {world_size} ranks" if rows != world_size \
                else f"world size {world_size}"
            raise ConfigError(f"robust aggregator {self.aggregator!r} with f={self.f} needs "
                              f"at least {limit} = {need} vectors, got {what}; lower f or "
                              "add ranks")


def min_world_size(aggregator: str, f: int) -> int:
    """Fewest vectors ``aggregator`` needs to tolerate ``f`` Byzantine ones."""
    return 2 * f + 3 if aggregator in ("krum", "multikrum") else 2 * f + 1


def _needs_gram(spec: ReduceSpec) -> bool:
    return spec.aggregator in DISTANCE_BASED or spec.pre is not None


def reduce_rows(rows: Tensor, spec: ReduceSpec, sync: Sync | None = None,
                center: Tensor | None = None, generator: torch.Generator | None = None
                ) -> Tensor:
    """Robust aggregate ``(m,)`` of ``rows`` ``(P, m)``; ``sync`` sums a tensor over the ranks
    holding the other shards (identity when the rows are whole vectors); ``center`` is this
    shard of the previous aggregate (centered clipping; default zero); ``generator`` draws
    bucketing's permutation and must be in the same state on every rank. No host read: the
    rows non-finite on any shard are masked on the device (:mod:`hexagram.robust.masked`)."""
    n = rows.shape[0]
    if not _needs_gram(spec):
        return coordinate_wise(rows, spec.aggregator, spec.f)
    cc = spec.aggregator == "centered_clip"
    x = rows
    if cc:  # the center rides along as an extra last row
        c0 = rows.new_zeros(rows.shape[1]) if center is None else center.to(rows.dtype)
        x = torch.cat([rows, c0[None]])
    g, ok, clean = _global_gram(x, sync or (lambda t: t))
    ok[n:] = True  # the center is ours, not a rank's: never dropped
    f = masked.lowered(spec.f, ok[:n])
    if spec.pre is not None:
        mixed, g, ok = _pre(clean, g, ok, f, spec, cc, generator)
        mixed = mixed.to(rows.dtype)  # the rows the aggregator sees, as without masking
        if spec.aggregator in COORDINATE_WISE:
            return _coordinate(mixed, ok, f, spec.aggregator, spec.f)
        clean = mixed.double()
    return _aggregate(clean, g, ok, f, spec).to(rows.dtype)


def coordinate_wise(rows: Tensor, aggregator: str, f: int) -> Tensor:
    """``median`` or ``trimmed_mean`` of the finite rows of ``rows`` ``(n, m)``, ``f``
    lowered by the number of dropped rows and capped at ``(kept - 1) // 2``; NaN when no
    row is finite (no contribution is left: the engine's check of what arrives, and a
    ``GradScaler``, must see it, not a zero gradient that an optimizer would step on).
    No host read: the dropped rows sort last (as +Inf) and the rows averaged are picked by
    counts on the device. With every row finite, the result is
    :func:`~hexagram.robust.aggregators.median` / ``trimmed_mean`` of ``rows``, bit for bit
    (with rows dropped the median still is; the trimmed mean is the same up to the order of
    its float sum).

    Example:
        >>> coordinate_wise(torch.tensor([[1.0], [2.0], [float("nan")], [9.0]]), "median", 1)
        tensor([2.])
    """
    ok = agg.finite_rows(rows)
    return _coordinate(rows, ok, masked.lowered(f, ok), aggregator, f)


def _coordinate(rows: Tensor, ok: Tensor, lowered: Tensor, aggregator: str, f: int
                ) -> Tensor:
    """:func:`coordinate_wise` of the rows ``ok`` keeps, ``lowered`` the 0-d ``f`` left
    (``f`` less the ranks dropped, before the cap)."""
    kept = ok.sum()  # 0-d, on the device
    f_eff = torch.minimum(lowered, torch.clamp((kept - 1) // 2, min=0))
    inf = torch.full_like(rows, float("inf"))
    s = agg.sort_rows(torch.where(ok[:, None], rows, inf))  # dropped rows last
    if aggregator == "median":
        mid = torch.stack([(kept - 1) // 2, kept // 2]).clamp(min=0)
        lo, hi = s.index_select(0, mid)
        out = torch.where(kept % 2 == 1, lo, (lo + hi) / 2)
    else:
        out = _trimmed(rows, s, ok, kept, f_eff, f)
    return torch.where(kept > 0, out, float("nan"))


def _trimmed(rows: Tensor, s: Tensor, ok: Tensor, kept: Tensor, f_eff: Tensor, f: int
             ) -> Tensor:
    """:func:`coordinate_wise`'s trimmed mean: ``s`` the rows sorted (dropped ones last),
    ``kept`` and ``f_eff`` device counts. Every row finite: the host's own sum of the rows
    kept (its order of summation depends on their number, known then); else the sum over
    the window ``[f_eff, kept - f_eff)`` of ``s`` (``f_eff == 0``: the kept rows in their
    order), zero elsewhere, divided by its size. (After bucketing every bucket may be kept
    while ``f`` was lowered by a dropped rank: the window then.)"""
    n = rows.shape[0]
    f_all = min(f, max(0, (n - 1) // 2))  # every row kept: no f lowered
    whole = rows.mean(dim=0) if f_all == 0 else s[f_all:n - f_all].mean(dim=0)
    pos = torch.arange(n, device=rows.device)
    plain = torch.where(ok[:, None], rows, torch.zeros_like(rows)).sum(dim=0)
    window = (pos >= f_eff) & (pos < kept - f_eff)
    trimmed = torch.where(window[:, None], s, torch.zeros_like(s)).sum(dim=0)
    count = (kept - 2 * f_eff).clamp(min=1).to(rows.dtype)
    dropped = torch.where(f_eff == 0, plain, trimmed) / count
    return torch.where((kept == n) & (f_eff == f_all), whole, dropped)


def _global_gram(x: Tensor, sync: Sync) -> tuple[Tensor, Tensor, Tensor]:
    """Gram matrix of the whole vectors (float64), the rows finite on every shard, and
    ``x`` in float64 with its non-finite rows zeroed (what the coefficients combine)."""
    n = x.shape[0]
    bad = ~agg.finite_rows(x)
    clean = x.to(torch.float64, copy=True)
    clean.masked_fill_(bad[:, None], 0.0)  # in place on the float64 copy: no second copy
    packed = torch.cat([(clean @ clean.T).reshape(-1), bad.double()])
    packed = sync(packed)
    return packed[: n * n].view(n, n), packed[n * n:] == 0, clean


def _pre(x: Tensor, g: Tensor, ok: Tensor, f: Tensor, spec: ReduceSpec, has_center: bool,
         generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """Mix the rank rows (not the center) of ``x`` (float64, excluded rows zero) with NNM
    or bucketing: ``W x``, ``W G W^T`` and the mixed rows kept."""
    k = x.shape[0] - int(has_center)
    if spec.pre == "nnm":
        w, kept = masked.nnm_mixing(g[:k, :k], ok[:k], f), ok[:k]
    else:
        drawn = agg.bucketing_mixing(k, spec.bucket_size, generator, device=g.device)
        w, kept = masked.bucketing_mixing(drawn, ok[:k])
    if has_center:  # keep the center as the last row, untouched
        w = torch.block_diag(w, torch.ones(1, 1, dtype=w.dtype, device=w.device))
        kept = torch.cat([kept, ok[k:]])
    return w @ x, w @ g @ w.T, kept


def _aggregate(x: Tensor, g: Tensor, ok: Tensor, f: Tensor, spec: ReduceSpec) -> Tensor:
    """Distance-based aggregate (float64) of the float64 rows ``x`` (excluded rows zero;
    centered clipping's center the extra last row), ``ok`` the rows kept, ``f`` the 0-d
    lowered ``f``. No row kept: NaN (as :func:`coordinate_wise`)."""
    n = x.shape[0] - int(spec.aggregator == "centered_clip")
    ok_r = ok[:n]
    kept = ok_r.sum()
    if spec.aggregator in ("krum", "multikrum"):
        f = torch.minimum(f, torch.clamp((kept - 3) // 2, min=0))
        weights = masked.krum_weights if spec.aggregator == "krum" \
            else masked.multikrum_weights
        c = weights(g, ok_r, f)
        few = ok_r.to(x.dtype) / kept.clamp(min=1).to(x.dtype)  # < 3 left: their mean
        c = torch.where(kept < 3, few, c)
    elif spec.aggregator == "geomed":
        c = masked.geomed_weights(g, ok_r, spec.iters, spec.nu)
    else:
        c = masked.centered_clip_weights(g, ok_r, spec.tau, spec.clip_iters)
    return torch.where(kept > 0, c, 0.0) @ x + torch.where(kept > 0, 0.0, float("nan"))
