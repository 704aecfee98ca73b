"""``measure_cluster`` (:mod:`hexagram.parallel.auto`) on the job layouts the two-rank tests of
``tests/test_parallel_auto.py`` do not run: one rank (no links to measure) and a number of
ranks per host that is not a power of two (refused, with the way out named)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hexagram.errors import HexagramError
from hexagram.launch import run_local
from hexagram.parallel.models import ResidualMLP


def _one_rank_worker() -> dict[str, Any]:
    from hexagram.parallel.auto import measure_cluster

    torch.manual_seed(0)
    model = ResidualMLP(12, 16, 5, blocks=2).double()
    x = torch.randn(8, 12, dtype=torch.float64)
    return {"plain": measure_cluster(torch.float64, memory_gb=2.5),
            "model": measure_cluster(torch.float64, model=model, example_inputs=x)}


@pytest.mark.timeout(200)
def test_one_rank_measures_compute_only() -> None:
    result = run_local(_one_rank_worker, 1, timeout=180)[0]
    plain, with_model = result["plain"], result["model"]
    for c in (plain, with_model):
        assert (c.hosts, c.devices_per_host, c.dtype_bytes) == (1, 1, 8)
        assert c.intra_latency_us == c.inter_latency_us == 0.0  # no links on one rank
        assert c.intra_host_gbps == c.inter_host_gbps == 100.0
        assert c.device_tflops > 0 and c.memory_gbps > 0
        assert c.tp_overhead_us == c.zero_overhead_us == c.step_overhead_us == 0.0
    assert plain.device_memory_gb == 2.5
    assert with_model.device_memory_gb == 4.0  # a CPU rank's default


def _three_ranks_worker() -> str:
    from hexagram.parallel.auto import measure_cluster

    try:
        measure_cluster(torch.float64)
    except HexagramError as exc:
        return str(exc)
    return ""


@pytest.mark.timeout(120)
def test_ranks_per_host_must_be_a_power_of_two() -> None:
    for message in run_local(_three_ranks_worker, 3, timeout=100):
        assert "power-of-two number of ranks" in message and "3 ranks with 3" in message
        assert "pass cluster=" in message
