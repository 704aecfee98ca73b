"""Robust aggregators on hand-computed cases, the shard-wise reduction against the whole-vector
one, and (where ByzFL is installed) against ByzFL's implementations on the same inputs."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Any

import pytest
import torch

from hexagram.robust import aggregators as agg
from hexagram.robust.shard_reduce import ReduceSpec, reduce_rows

# 4 honest points near (1, 1) and one attacker far away
X = torch.tensor([[1.0, 1.0], [1.2, 0.8], [0.8, 1.2], [1.0, 1.4], [50.0, -50.0]])


def test_coordinate_wise_by_hand() -> None:
    assert torch.equal(agg.median(X), torch.tensor([1.0, 1.0]))
    even = torch.tensor([[0.0, 4.0], [1.0, 3.0], [2.0, 2.0], [10.0, 1.0]])
    assert torch.equal(agg.median(even), torch.tensor([1.5, 2.5]))  # mean of middle two
    # trimmed mean, f=1: drop min and max per coordinate: x: 1.0,1.0,1.2 y: 0.8,1.0,1.2
    assert torch.allclose(agg.trimmed_mean(X, 1), torch.tensor([3.2 / 3, 1.0]))
    assert torch.equal(agg.trimmed_mean(X, 0), X.mean(0))


def test_krum_and_multikrum_by_hand() -> None:
    # squared distances from row 0 to rows 1..3: 0.08, 0.08, 0.16; n - f - 1 = 3 nearest
    scores = agg.krum_scores(agg.gram(X), f=1)
    assert scores[0].item() == pytest.approx((0.08 + 0.08 + 0.16) / 3)
    assert int(scores.argmin()) == 0
    assert torch.equal(agg.krum(X, 1), X[0])
    # Multi-Krum keeps the n - f = 4 honest rows: their mean
    assert torch.allclose(agg.multikrum(X, 1), X[:4].mean(0))


def test_geomed_and_centered_clip_by_hand() -> None:
    pts = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    # Weiszfeld from 0: step 1 weights 1/0.1 (clamped) and 1/2 -> z = (2/2)/(10 + 0.5) * ...
    z1 = torch.tensor([0.5 * 2.0 / (10.0 + 0.5), 0.0])
    assert torch.allclose(agg.geomed(pts, iters=1), z1)
    assert torch.allclose(agg.geomed(X, iters=50, nu=1e-6), torch.tensor([1.0, 1.0]), atol=0.2)
    # one clipping step from center 0 with tau 1: row norms 0 and 2 -> (0 + (2,0)/2) / 2
    assert torch.allclose(agg.centered_clip(pts, tau=1.0), torch.tensor([0.5, 0.0]))
    # a center far away is pulled at most tau per step
    center = torch.tensor([10.0, 0.0])
    out = agg.centered_clip(pts, tau=1.0, iters=1, center=center)
    assert torch.allclose(out, torch.tensor([9.0, 0.0]))


def test_pre_aggregation_by_hand() -> None:
    # NNM, f=1: each row averages itself and its 3 nearest others of the 5; the outlier's
    # 4 nearest are itself and 3 honest rows, so it is pulled towards them
    mixed = agg.nnm(X, 1)
    assert torch.allclose(mixed[0], X[:4].mean(0))
    assert mixed[4, 0] < 20.0
    g = torch.Generator().manual_seed(0)
    w = agg.bucketing_mixing(5, 2, g)
    assert w.shape == (3, 5)
    assert torch.allclose(w.sum(1), torch.ones(3, dtype=w.dtype))
    assert torch.equal((w > 0).sum(0), torch.ones(5, dtype=torch.long))  # each row once


def test_bad_f_is_named() -> None:
    with pytest.raises(ValueError, match=r"f=2.*at least 7.*got 5"):
        agg.krum(X, 2)
    with pytest.raises(ValueError, match=r"f=3.*at least 7"):
        agg.trimmed_mean(X, 3)


@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean", "krum", "multikrum",
                                        "geomed", "centered_clip"])
@pytest.mark.parametrize("pre", [None, "nnm", "bucketing"])
def test_sharded_reduction_equals_whole_vectors(aggregator: str, pre: str | None) -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 12)
    x[4] *= 30
    spec = ReduceSpec(aggregator=aggregator, f=1, pre=pre)
    center = torch.randn(12)
    whole = reduce_rows(x, spec, center=center, generator=torch.Generator().manual_seed(3))
    # three shards; "sync" sums the partial Gram matrices of all three, as an allreduce would
    shards = x.split(4, dim=1)
    partial = []

    def sync_all(t: torch.Tensor) -> torch.Tensor:
        partial.append(t)
        return t

    for i, s in enumerate(shards):  # first pass records each shard's partial sums
        reduce_rows(s, spec, sync_all, center[4 * i:4 * i + 4],
                    torch.Generator().manual_seed(3))
    if not partial:  # coordinate-wise without pre: no sync at all
        parts = [reduce_rows(s, spec) for s in shards]
    else:
        total = torch.stack(partial).sum(0)
        parts = [reduce_rows(s, spec, lambda t: total.clone(), center[4 * i:4 * i + 4],
                             torch.Generator().manual_seed(3)) for i, s in enumerate(shards)]
    assert torch.allclose(torch.cat(parts), whole, atol=1e-5)


@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean", "krum", "geomed"])
def test_nonfinite_rows_are_dropped(aggregator: str) -> None:
    spec = ReduceSpec(aggregator=aggregator, f=1)
    bad = torch.cat([X[:4], torch.tensor([[float("nan"), float("inf")]])])
    out = reduce_rows(bad, spec)
    assert torch.isfinite(out).all()
    clean = reduce_rows(X[:4], ReduceSpec(aggregator=aggregator, f=0))
    assert torch.allclose(out, clean, atol=1e-6)


def test_sort_rows_equals_torch_sort() -> None:
    g = torch.Generator().manual_seed(0)
    for n in [1, 2, 3, 4, 5, 6, 7, 8, 11, agg.NETWORK_MAX_ROWS, agg.NETWORK_MAX_ROWS + 1]:
        x = torch.randn(n, 33, generator=g)
        x[:, :5] = torch.randint(0, 3, (n, 5), generator=g).float()  # ties
        x[0, 5] = float("inf")
        x[-1, 6] = -float("inf")
        assert torch.equal(agg.sort_rows(x), x.sort(dim=0).values), n
    odd, even = torch.randn(7, 9, generator=g), torch.randn(6, 9, generator=g)
    assert torch.equal(agg.median(odd), odd.median(dim=0).values)
    assert torch.equal(agg.trimmed_mean(odd, 2), odd.sort(dim=0).values[2:5].mean(dim=0))
    assert torch.allclose(agg.median(even), even.sort(dim=0).values[2:4].mean(dim=0))


def test_finite_rows_scans_only_suspect_rows() -> None:
    x = torch.ones(5, 4)
    x[1, 2] = float("nan")
    x[2, 0] = float("inf")
    x[3] = 3e38  # finite values whose sum overflows: still finite
    x[4, 1], x[4, 3] = float("inf"), -float("inf")  # inf - inf: the sum is NaN
    assert finite_list(x) == [True, False, False, True, False]
    assert finite_list(torch.empty(3, 0)) == [True, True, True]


def finite_list(x: torch.Tensor) -> list[bool]:
    return [bool(v) for v in agg.finite_rows(x)]


# -- ByzFL, where installed (benchmark-only dependency) ---------------------------------
def _byzfl() -> Any:
    loaded = sys.modules.get("byzfl")
    if loaded is not None and hasattr(loaded, "__path__"):  # already loaded (or stubbed)
        from byzfl.aggregators import aggregators, preaggregators

        return aggregators, preaggregators
    spec = importlib.util.find_spec("byzfl")
    if spec is None or spec.origin is None:
        pytest.skip("byzfl not installed (pip install 'hexagram[byzantine]'); "
                    "reference comparison skipped")
    # byzfl/__init__ imports its training framework (torchvision); the aggregators need only
    # torch and numpy, so load them without the package's __init__
    pkg = types.ModuleType("byzfl")
    pkg.__path__ = [os.path.dirname(spec.origin)]
    sys.modules["byzfl"] = pkg
    from byzfl.aggregators import aggregators, preaggregators

    return aggregators, preaggregators


@pytest.mark.parametrize("n,f", [(5, 1), (7, 2), (6, 1)])
def test_equals_byzfl(n: int, f: int) -> None:
    a, p = _byzfl()
    torch.manual_seed(n)
    x = torch.randn(n, 40)  # ByzFL computes in float32
    x[:f] = x[:f] * -10 + 3
    pairs = [(agg.median(x), a.Median()(x.clone())),
             (agg.trimmed_mean(x, f), a.TrMean(f=f)(x.clone())),
             (agg.geomed(x, iters=3, nu=0.1), a.GeometricMedian(nu=0.1, T=3)(x.clone())),
             (agg.centered_clip(x, tau=2.0, iters=3),
              a.CenteredClipping(tau=2.0, L=3)(x.clone())),
             (agg.nnm(x, f), p.NNM(f=f)(x.clone()))]
    # the algorithm's reduction (rows masked on the device) against the same references
    pairs += [(reduce_rows(x, ReduceSpec(aggregator="geomed", f=f)),
               a.GeometricMedian(nu=0.1, T=3)(x.clone())),
              (reduce_rows(x, ReduceSpec(aggregator="centered_clip", f=f, tau=2.0,
                                         clip_iters=3)),
               a.CenteredClipping(tau=2.0, L=3)(x.clone()))]
    if n >= 2 * f + 3:
        pairs += [(agg.krum(x, f), a.Krum(f=f)(x.clone())),
                  (agg.multikrum(x, f), a.MultiKrum(f=f)(x.clone())),
                  (reduce_rows(x, ReduceSpec(aggregator="krum", f=f)), a.Krum(f=f)(x.clone())),
                  (reduce_rows(x, ReduceSpec(aggregator="multikrum", f=f)),
                   a.MultiKrum(f=f)(x.clone()))]
    for ours, theirs in pairs:
        assert torch.allclose(ours, torch.as_tensor(theirs), atol=1e-5)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean"])
def test_coordinate_wise_drops_bad_rows_without_reading_them(
        aggregator: str, fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Device counts (no host read) give the host path's result: the finite rows selected,
    ``f`` lowered by the dropped ones and capped, the aggregator applied; bit for bit when
    every row is finite (and for the median always), else up to the float sum's order."""
    from hexagram.compress import packing
    from hexagram.robust.shard_reduce import coordinate_wise

    monkeypatch.setattr(packing, "CPU_FAST_PATHS", fast)
    g = torch.Generator().manual_seed(7)
    for trial in range(120):
        n, f = int(torch.randint(1, 10, (1,), generator=g)), int(torch.randint(0, 3, (1,),
                                                                               generator=g))
        x = torch.randn(n, 17, generator=g)
        bad = torch.rand(n, generator=g) < (0.3 if trial % 3 else 0.0)
        x[bad, int(torch.randint(0, 17, (1,), generator=g))] = float("nan") \
            if trial % 2 else float("inf")
        kept = x[~bad]
        f_eff = min(max(0, f - int(bad.sum())), max(0, (kept.shape[0] - 1) // 2))
        if kept.shape[0] == 0:  # nothing left to aggregate: NaN (the arrival check sees it)
            expect = torch.full((17,), float("nan"))
        elif aggregator == "median":
            expect = agg.median(kept)
        else:
            expect = agg.trimmed_mean(kept, f_eff)
        got = coordinate_wise(x, aggregator, f)
        if aggregator == "median" or not bool(bad.any()):
            assert torch.equal(got.view(torch.int32), expect.view(torch.int32)), (trial, n, f)
        else:
            assert torch.allclose(got, expect, rtol=1e-6, atol=1e-7, equal_nan=True), \
                (trial, n, f)
