"""Core sharing in the cost model, the least-squares link fit and the model-shaped
calibration (``cluster.cores_per_host``, ``inter.core_factor``, ``calibrate.fit_alpha_beta``,
``overheads.model_linear_shape``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hexagram.errors import ConfigError, HexagramError
from hexagram.launch import run_local
from hexagram.parallel import Cluster, Constraints, capture, gpt, plan_graph
from hexagram.parallel.calibrate import fit_alpha_beta, with_model_figures
from hexagram.parallel.inter import core_factor, step_time
from hexagram.parallel.overheads import model_linear_shape, split_scale

_SHARED = Cluster(hosts=1, devices_per_host=4, cores_per_host=2.0)


def test_sharing_is_busy_ranks_per_core_and_absent_by_default() -> None:
    assert _SHARED.sharing(4) == 2.0 and _SHARED.sharing(3) == 1.5
    assert _SHARED.sharing(2) == 1.0 and _SHARED.sharing(0.5) == 1.0
    assert Cluster(devices_per_host=8).sharing(8) == 1.0  # hand-written: a core per device
    with pytest.raises(ConfigError, match="cores_per_host"):
        Cluster(devices_per_host=4, cores_per_host=0.5)
    with pytest.raises(ConfigError, match="cores_per_host"):
        Cluster(devices_per_host=4, cores_per_host=-1.0)


def test_step_time_prices_pipeline_ranks_idle_in_the_bubble() -> None:
    # 4 stages x 1 s, 4 micro-batches: 7 slots of 1 s with 1,2,3,4,3,2,1 busy ranks, on 2
    # cores 1,1,1.5,2,1.5,1,1 s = 9 s, against 7 x 2 s priced with all busy => 7 x 9/14
    assert step_time([1.0] * 4, 4, _SHARED) == pytest.approx(4.5)
    assert step_time([1.0] * 4, 4, _SHARED.replace(cores_per_host=0.0)) == pytest.approx(7.0)
    assert step_time([1.0] * 4, 4) == pytest.approx(7.0)
    # 2 stages of 2 ranks, 4 micro-batches: slots busy 2,4,4,4,2 => (1+2+2+2+1) / (5 x 2)
    assert core_factor([1.0, 1.0], 4, _SHARED, [2, 2]) == pytest.approx(0.8)
    assert step_time([1.0, 1.0], 4, _SHARED, [2, 2]) == pytest.approx(4.0)
    # uneven stages 1 s and 3 s, 2 ranks each, 2 micro-batches: slots of 1, 3, 3 s with
    # 2, (2 + 6) / 3 and 2 busy => 1 + 3 x 4/3 + 3 = 8 s against 7 x 2 => 8/14
    assert core_factor([1.0, 3.0], 2, _SHARED, [2, 2]) == pytest.approx(8 / 14)
    # one stage: every rank busy, as the compute was measured
    assert step_time([2.0], 4, _SHARED) == pytest.approx(8.0)
    # overheads are added after the factor, unscaled
    c = _SHARED.replace(microbatch_overhead_us=1000.0, step_overhead_us=500.0)
    assert step_time([1.0] * 4, 4, c) == pytest.approx(4.5 + 7e-3 + 5e-4)
    with pytest.raises(ValueError, match="one per stage"):
        core_factor([1.0, 1.0], 4, _SHARED, [4])


def test_planner_prices_a_pipeline_faster_when_its_ranks_share_cores() -> None:
    graph = capture(gpt(layers=4, hidden=64, heads=4, vocab=128, seq=16, device="meta",
                        dtype=torch.float64),
                    torch.zeros(16, 16, dtype=torch.long, device="meta"))
    base = Cluster(hosts=1, devices_per_host=4, intra_host_gbps=10, inter_host_gbps=10,
                   device_tflops=0.03, memory_gbps=20, op_overhead_us=30, dtype_bytes=8,
                   device_memory_gb=4)
    alone = plan_graph(graph, base, Constraints(pp=4, microbatches=4))
    shared = plan_graph(graph, base.replace(cores_per_host=2.0),
                        Constraints(pp=4, microbatches=4))
    ratio = shared.step_time_s / alone.step_time_s
    assert 0.5 < ratio < 0.9  # the bubble frees cores: priced faster, never below half
    dp = plan_graph(graph, base.replace(cores_per_host=2.0), Constraints(dp=4))
    assert dp.step_time_s == pytest.approx(plan_graph(graph, base, Constraints(dp=4))
                                           .step_time_s)


def test_fit_alpha_beta_recovers_alpha_and_rate_by_least_squares() -> None:
    n, alpha, rate = 4, 1e-3, 0.5e9  # 1 ms, 0.5 GB/s = 4 Gbit/s
    sizes = [8e3, 5.12e5, 2.048e6, 8e6]
    times = [2 * (n - 1) * alpha + 2 * (n - 1) / n * x / rate for x in sizes]
    fit = fit_alpha_beta(n, sizes, times)
    assert fit["latency_us"] == pytest.approx(1000.0)
    assert fit["gbps"] == pytest.approx(4.0)
    # noise on the small sizes moves the fit little: the large sizes carry the rate
    noisy = [t + e for t, e in zip(times, (2e-3, -2e-3, 1e-3, 0.0))]
    assert 3.0 < fit_alpha_beta(n, sizes, noisy)["gbps"] < 5.0
    # alpha comes from the smallest size: 3 ms of noise on the 8 MB allreduce leaves it
    # within 1% (the least-squares intercept would give 950 us)
    late = [*times[:3], times[3] + 3e-3]
    assert fit_alpha_beta(n, sizes, late)["latency_us"] == pytest.approx(1000.0, rel=0.01)
    # 6 ms more on the 8 KB allreduce = 1 ms more on each of its 2(n-1) = 6 latencies
    # (the intercept would give 1422 us)
    slow_small = [times[0] + 6e-3, *times[1:]]
    assert fit_alpha_beta(n, sizes, slow_small)["latency_us"] == pytest.approx(2000.0,
                                                                              rel=0.01)


def test_fit_alpha_beta_refuses_times_that_do_not_grow() -> None:
    # what run F's 4-rank calibration hit: the 2 MB allreduce no slower than the 8 KB one
    # in the noise of 4 ranks on 2 cores; the old two-point fit clipped the slope and
    # reported 12,000,000 Gbit/s
    with pytest.raises(HexagramError, match="larger sizes"):
        fit_alpha_beta(4, [8e3, 2e6], [9e-3, 8.5e-3])
    with pytest.raises(ValueError, match="two sizes"):
        fit_alpha_beta(4, [8e3, 8e3], [1e-3, 1e-3])


def test_with_model_figures_sets_cores_only_when_ranks_share_them() -> None:
    c = Cluster(hosts=1, devices_per_host=4, device_tflops=1.0)
    shared = with_model_figures(c, {"compute_scale": 2.0, "cores": 1.7})
    assert shared.cores_per_host == 1.7 and shared.device_tflops == 0.5
    assert with_model_figures(c, {"compute_scale": 1.0, "cores": 4.0}).cores_per_host == 0.0
    assert with_model_figures(c, {}) == c


def test_two_batch_sizes_split_the_scale_into_rate_and_per_operator_parts() -> None:
    """measured = op_scale x ops + work_scale x work at both points, solved by hand; a
    negative per-operator share falls back to a rate-only fit; a larger
    batch measured no slower keeps the one scale of the small point."""
    # ops 20 ms at both sizes, rates 30 -> 120 ms; measured 100 -> 340 ms:
    # work = (340 - 100) / (120 - 30) = 8/3, op = (100 - 8/3 x 30) / 20 = 1
    assert split_scale((0.10, 0.02, 0.03), (0.34, 0.02, 0.12)) == {
        "work_scale": pytest.approx(8 / 3, abs=1e-6), "op_scale": pytest.approx(1.0, abs=1e-6)}
    # 4x the batch measured 4x the time while the roofline grew 1.7x: per-op share < 0;
    # the rate alone fits the relative errors: w = sum(W/m) / sum((W/m)^2)
    got = split_scale((0.10, 0.05, 0.03), (0.40, 0.05, 0.06))
    assert got["op_scale"] == 0.0
    assert got["work_scale"] == pytest.approx((0.3 + 0.15) / (0.3 ** 2 + 0.15 ** 2), abs=1e-6)
    # three consistent points (a 2-row micro-batch added) give the same exact scales, and
    # a noisy one moves the fit less than it would move a two-point solve
    tiny = (0.02 * 1.0 + 0.0075 * 8 / 3, 0.02, 0.0075)
    three = split_scale((0.10, 0.02, 0.03), (0.34, 0.02, 0.12), tiny)
    assert three == {"work_scale": pytest.approx(8 / 3, abs=1e-5),
                     "op_scale": pytest.approx(1.0, abs=1e-5)}
    noisy = split_scale((0.10, 0.02, 0.03), (0.34 * 1.1, 0.02, 0.12), tiny)
    two = split_scale((0.10, 0.02, 0.03), (0.34 * 1.1, 0.02, 0.12))
    assert abs(noisy["op_scale"] - 1.0) < abs(two["op_scale"] - 1.0)
    assert split_scale((0.10, 0.02, 0.03), (0.09, 0.02, 0.12)) == {"work_scale": 2.0,
                                                                    "op_scale": 2.0}
    c = Cluster(hosts=1, devices_per_host=4, device_tflops=1.0, op_overhead_us=10.0)
    both = with_model_figures(c, {"compute_scale": 3.0, "work_scale": 4.0, "op_scale": 0.5})
    assert both.device_tflops == 0.25 and both.op_overhead_us == 5.0


def test_model_linear_shape_is_the_largest_linear_at_its_rows() -> None:
    model = gpt(layers=2, hidden=32, heads=4, vocab=50, seq=8, dtype=torch.float64)
    x = torch.randint(0, 50, (8, 8))
    assert model_linear_shape(model, x, world=4) == (32, 128, 2 * 8)  # fc1, 2 samples x 8
    assert model_linear_shape(nn.Sequential(nn.ReLU()), torch.zeros(4, 3)) is None
    with pytest.raises(TypeError, match="batched tensor"):
        model_linear_shape(model, "tokens")


def _model_job() -> dict[str, float]:
    import hexagram as hx
    from hexagram.parallel.calibrate import measure_job

    hx.init()
    torch.manual_seed(0)
    model = gpt(layers=1, hidden=32, heads=4, vocab=64, seq=8, dtype=torch.float64)
    x = torch.randint(0, 64, (8, 8))
    return measure_job(torch.float64, 5, model=model, inputs=x, targets=x)


@pytest.mark.timeout(240)
def test_model_shaped_calibration_on_two_ranks() -> None:
    res = run_local(_model_job, 2, timeout=220)
    figures = res[0]
    assert res[1] == figures  # medians over ranks, the same everywhere
    for key in ("tp_overhead_us", "zero_overhead_us", "microbatch_overhead_us",
                "latency_us", "gbps", "compute_scale"):
        assert math.isfinite(figures[key]) and figures[key] >= 0.0, key
    assert 0.0 < figures["gbps"] < 1e4  # a fitted rate, not the clipped 1e7 of old
    assert 1.0 <= figures["cores"] <= 2.0
    # the model's own gradient sync, timed: positive, and its scale reproduces it
    assert figures["dp_sync_ms"] > 0.0 and figures["dp_sync_scale"] > 0.0
    assert figures["zero_rs_as_allreduce"] == 1.0  # gloo: see parallel/zero.py
