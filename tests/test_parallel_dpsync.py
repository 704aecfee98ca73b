"""The executor's bucketed data-parallel sync: buckets, the average, its price and its timing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hexagram.launch import run_local
from hexagram.parallel import Cluster, capture
from hexagram.parallel.calibrate import with_model_figures
from hexagram.parallel.cost import Mesh, strategies
from hexagram.parallel.dpsync import allreduce_mean, grad_buckets, measure_dp_sync, sync_price
from hexagram.parallel.plans import DP_BUCKET_BYTES


def test_grad_buckets_group_per_dtype_up_to_the_cap() -> None:
    f64 = [torch.zeros(10, dtype=torch.float64) for _ in range(3)]  # 80 bytes each
    f32 = torch.zeros(40, dtype=torch.float32)  # 160 bytes: over the cap, alone
    buckets = grad_buckets([f64[0], f32, f64[1], f64[2]], cap=150)
    assert [[id(t) for t in b] for b in buckets] == [[id(f32)], [id(f64[0]), id(f64[1])],
                                                     [id(f64[2])]]
    assert [len(b) for b in grad_buckets(f64)] == [3]  # the default cap: one bucket


def _average_job() -> dict[str, object]:
    import torch.distributed as dist

    import hexagram as hx

    hx.init()
    r = dist.get_rank()
    grads = [torch.full((3, 4), float(r), dtype=torch.float64),
             torch.full((5,), 2.0 * r, dtype=torch.float32),
             torch.full((2,), 10.0 + r, dtype=torch.float64)]
    allreduce_mean(grads, None, dist.get_world_size())
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)).double()
    cluster = Cluster(hosts=1, devices_per_host=2, intra_latency_us=50.0, dtype_bytes=8)
    return {"grads": [g.tolist() for g in grads],
            "timed": measure_dp_sync(model, cluster, torch.device("cpu"), repeat=3)}


@pytest.mark.timeout(120)
def test_allreduce_mean_averages_every_dtype_in_place_and_is_timed() -> None:
    res = run_local(_average_job, 2, timeout=100)
    for r in res:
        a, b, c = r["grads"]
        assert a == [[0.5] * 4] * 3 and b == [1.0] * 5 and c == [10.5] * 2
        assert r["timed"]["dp_sync_ms"] > 0.0 and r["timed"]["dp_sync_scale"] > 0.0
    assert res[0]["timed"] == res[1]["timed"]  # the slowest rank's time, on every rank


def test_dp_sync_scale_multiplies_the_exact_sync_only() -> None:
    g = capture(nn.Sequential(nn.Linear(64, 64)), torch.zeros(4, 64))
    c = Cluster(hosts=1, devices_per_host=2, intra_latency_us=1000.0, intra_host_gbps=8.0,
                dtype_bytes=4)

    def sync(cluster: Cluster) -> float:  # d=2 against d=1 at the same per-device batch
        two, one = (strategies(g.layers[0], 1, Mesh(cluster=cluster, d=d, t=1, b=2,
                                                    microbatches=1))[0].time for d in (2, 1))
        return two - one

    nbytes = 4 * (64 * 64 + 64)
    assert sync(c) == pytest.approx(2e-3 * nbytes / DP_BUCKET_BYTES + nbytes / 1e9)
    scaled = with_model_figures(c, {"dp_sync_scale": 2.5})
    assert scaled.dp_sync_scale == 2.5
    assert sync(scaled) == pytest.approx(2.5 * sync(c))
    assert with_model_figures(c, {}) == c


def test_the_sync_is_priced_on_the_hosts_it_crosses() -> None:
    # 2 hosts x 2 ranks: the ring's 4 hops inside a host and 2 across (the kernel's price),
    # not 6 hops at the host's own latency: the measured scale is against this
    c = Cluster(hosts=2, devices_per_host=2, intra_latency_us=10.0, intra_host_gbps=80.0,
                inter_latency_us=1000.0, inter_host_gbps=0.8, dtype_bytes=4)
    nbytes = 4e6
    share = nbytes / DP_BUCKET_BYTES
    ring = (4 * 10e-6 + 2 * 1000e-6) * share + 1.5 * nbytes / 0.1e9
    assert sync_price(c, nbytes) == pytest.approx(ring)
    one_host = c.replace(hosts=1, devices_per_host=4)
    assert sync_price(one_host, nbytes) == pytest.approx(6 * 10e-6 * share + 1.5 * nbytes / 10e9)
