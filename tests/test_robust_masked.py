"""Distance-based aggregators and pre-aggregation exclude non-finite rows on the device
(:mod:`hexagram.robust.masked`): the result equals selecting the finite rows on the host,
lowering ``f`` by their number and applying the plain aggregator (the behaviour before the
masking; up to float-sum order), with no host read on the path CUDA takes."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from hexagram.robust import aggregators as agg
from hexagram.robust.shard_reduce import COORDINATE_WISE, ReduceSpec, reduce_rows

DISTANCE = ["krum", "multikrum", "geomed", "centered_clip"]


def _host_rows(x: Tensor, ok: list[bool], f: int, spec: ReduceSpec, seed: int) -> Tensor:
    """The rows the aggregator sees: the finite ones, mixed by ``spec.pre`` on the host.
    Bucketing draws its permutation over all rows and averages each bucket's finite
    members (an empty bucket is dropped): the guarantee (at most ``f`` left Byzantine, so
    at most ``f`` buckets corrupted) is bucketing's own."""
    keep = x[torch.tensor(ok, dtype=torch.bool)]
    if spec.pre == "nnm":
        return agg.nnm(keep, f) if len(keep) else keep
    if spec.pre == "bucketing":
        w = agg.bucketing_mixing(x.shape[0], spec.bucket_size, torch.Generator().manual_seed(seed))
        means = []
        for b in range(w.shape[0]):
            members = [j for j in range(x.shape[0]) if float(w[b, j]) > 0 and ok[j]]
            if members:
                means.append((x[members].double().sum(0) / len(members)).to(x.dtype))
        return torch.stack(means) if means else keep
    return keep


def reference(x: Tensor, spec: ReduceSpec, center: Tensor, seed: int) -> Tensor:
    """Host selection of the finite rows, ``f`` lowered, the plain aggregator."""
    ok = [bool(torch.isfinite(r).all()) for r in x]
    f = max(0, spec.f - ok.count(False))
    rows = _host_rows(x, ok, f, spec, seed)
    k = rows.shape[0]
    if k == 0:  # no contribution left: NaN, for the engine's arrival check to see
        return torch.full((x.shape[1],), float("nan"))
    if spec.aggregator == "median":
        return agg.median(rows)
    if spec.aggregator == "trimmed_mean":
        return agg.trimmed_mean(rows, min(f, (k - 1) // 2))
    if spec.aggregator in ("krum", "multikrum"):
        if k < 3:
            return rows.mean(0)
        fk = min(f, max(0, (k - 3) // 2))
        return agg.krum(rows, fk) if spec.aggregator == "krum" else agg.multikrum(rows, fk)
    if spec.aggregator == "geomed":
        return agg.geomed(rows, spec.iters, spec.nu)
    return agg.centered_clip(rows, spec.tau, spec.clip_iters, center)


def _rows(g: torch.Generator, bad_rate: float) -> tuple[Tensor, int]:
    n = int(torch.randint(3, 10, (1,), generator=g))
    x = torch.randn(n, 13, generator=g)
    x[: int(torch.randint(0, 3, (1,), generator=g))] *= -20  # far rows, to be outvoted
    bad = torch.rand(n, generator=g) < bad_rate
    col = int(torch.randint(0, 13, (1,), generator=g))
    x[bad, col] = float("nan") if col % 2 else float("inf")
    return x, int(torch.randint(0, 3, (1,), generator=g))


@pytest.mark.parametrize("pre", [None, "nnm", "bucketing"])
@pytest.mark.parametrize("aggregator", [*DISTANCE, *COORDINATE_WISE])
def test_masked_equals_host_selection(aggregator: str, pre: str | None, device_path: None
                                      ) -> None:
    if pre is None and aggregator in COORDINATE_WISE:
        pytest.skip("no Gram matrix: coordinate_wise, tested in test_robust_aggregators")
    g = torch.Generator().manual_seed(11)
    for trial in range(60):
        x, f = _rows(g, 0.0 if trial % 4 == 0 else 0.35 if trial % 5 else 1.0)
        spec = ReduceSpec(aggregator=aggregator, f=f, pre=pre, tau=3.0, clip_iters=2)
        center = torch.randn(13, generator=g)
        got = reduce_rows(x, spec, center=center, generator=torch.Generator().manual_seed(trial))
        want = reference(x, spec, center, trial)
        assert torch.isfinite(got).all() == torch.isfinite(want).all(), (trial, f)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True), \
            (trial, x.shape[0], f)
        if aggregator == "krum" and pre is None and bool(want.isfinite().all()):  # exactly a row
            assert torch.equal(got, want), trial


@pytest.mark.parametrize("aggregator", DISTANCE)
def test_all_finite_rows_give_the_plain_aggregator(aggregator: str) -> None:
    # what ByzFL is compared against (test_robust_aggregators.test_equals_byzfl)
    torch.manual_seed(3)
    x = torch.randn(7, 40)
    x[:2] = x[:2] * -10 + 3
    center = torch.randn(40)
    got = reduce_rows(x, ReduceSpec(aggregator=aggregator, f=2, tau=2.0, clip_iters=3),
                      center=center)
    want = {"krum": lambda: agg.krum(x, 2), "multikrum": lambda: agg.multikrum(x, 2),
            "geomed": lambda: agg.geomed(x, 3, 0.1),
            "centered_clip": lambda: agg.centered_clip(x, 2.0, 3, center)}[aggregator]()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    if aggregator in ("krum", "multikrum"):  # the same rows selected: the same sum
        assert torch.equal(got, want)


@pytest.mark.parametrize("pre", [None, "nnm", "bucketing"])
@pytest.mark.parametrize("aggregator", [*DISTANCE, "trimmed_mean"])
def test_no_host_read_with_a_nonfinite_row(aggregator: str, pre: str | None,
                                           device_path: None) -> None:
    from test_host_reads import _Counter

    x = torch.randn(5, 64)
    x[4, 3] = float("nan")
    spec = ReduceSpec(aggregator=aggregator, f=1, pre=pre)
    center, gen = torch.randn(64), torch.Generator().manual_seed(0)
    counter = _Counter()
    counter.install()
    try:
        counter.on = True
        out = reduce_rows(x, spec, center=center, generator=gen)
    finally:
        counter.on = False
        counter.uninstall()
    assert counter.sites == [], "\n".join(counter.sites)
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pre", [None, "nnm", "bucketing"])
@pytest.mark.parametrize("aggregator", [*DISTANCE, "median"])
def test_no_sync_on_cuda(aggregator: str, pre: str | None) -> None:
    """On CUDA, any synchronization inside the reduction raises (sync debug mode), a NaN row
    included; the result is the CPU's."""
    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    x[4, 7] = float("nan")
    spec = ReduceSpec(aggregator=aggregator, f=1, pre=pre)
    center = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    xc, cc = x.cuda(), center.cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = reduce_rows(xc, spec, center=cc, generator=gen)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all()
    if pre != "bucketing":  # bucketing draws its permutation on the device: another one
        assert torch.allclose(out.cpu(), reduce_rows(x, spec, center=center), atol=1e-5)
