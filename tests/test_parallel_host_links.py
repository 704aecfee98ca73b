"""The links inside and between hosts, fitted apart (:mod:`hexagram.parallel.host_links`).

On loopback (4 ranks laid out as 2 hosts of 2) ``measure_cluster`` gives every rank the
same two links and a bad layout is refused; on the network lab (2 namespaces x 2 ranks,
200 Mbit/s between them, root only) the network is fitted at its shaped rate and the
host's own link far above it (one all-rank fit, what ``measure_cluster`` priced both links
with before, gives about the network's rate for both). ``measure_cluster`` lays the fits
out as hosts (``auto._cluster_of``).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from hexagram.bench.lab import unavailable_reason
from hexagram.launch import run_local
from hexagram.parallel.cluster import Cluster
from hexagram.parallel.host_links import on_hosts


def _measure_worker() -> dict[str, Any]:
    import hexagram as hx
    from hexagram.errors import HexagramError
    from hexagram.parallel.auto import measure_cluster
    from hexagram.parallel.host_links import fit_host_links

    hx.init(timeout=60)
    try:
        fit_host_links(3)
        refused = ""
    except HexagramError as exc:
        refused = str(exc)
    return {"refused": refused, "cluster": measure_cluster(torch.float64)}


@pytest.mark.timeout(150)
def test_measure_cluster_on_two_hosts_gives_every_rank_the_same_two_links() -> None:
    """4 ranks as 2 hosts of 2 (LOCAL_WORLD_SIZE): the links are fitted apart, DTensor is
    measured inside a host (a 2-D device mesh's host dimension), every rank agrees."""
    results = run_local(_measure_worker, 4, env={"LOCAL_WORLD_SIZE": "2"}, timeout=130)
    assert "4 ranks do not split into hosts of 3" in results[0]["refused"]
    c = results[0]["cluster"]
    assert all(r["cluster"] == c for r in results)  # one figure per link, on every rank
    assert (c.hosts, c.devices_per_host) == (2, 2)
    assert c.intra_latency_us > 0 and c.inter_latency_us > 0
    assert c.intra_host_gbps > 0 and c.inter_host_gbps > 0
    assert c.tp_overhead_us >= 0 and c.zero_overhead_us >= 0


def test_on_hosts_lays_out_the_cluster_with_both_links() -> None:
    figures = {"intra_latency_us": 20.0, "intra_gbps": 50.0, "inter_latency_us": 300.0,
               "inter_gbps": 0.1}
    one = Cluster(hosts=1, devices_per_host=4, intra_host_gbps=1.0, inter_host_gbps=1.0)
    c = on_hosts(one, figures, 2)
    assert (c.hosts, c.devices_per_host) == (2, 2)
    assert (c.intra_latency_us, c.intra_host_gbps) == (20.0, 50.0)
    assert (c.inter_latency_us, c.inter_host_gbps) == (300.0, 0.1)
    assert on_hosts(one, {}, 2) == one  # nothing fitted apart: unchanged
    assert on_hosts(one, figures, 4) == one  # one host


def test_measure_cluster_builds_hosts_from_the_two_fits() -> None:
    from hexagram.parallel.auto import _cluster_of

    figures = {"latency_us": 900.0, "gbps": 0.1, "device_tflops": 0.05, "memory_gbps": 5.0,
               "op_overhead_us": 10.0, "intra_latency_us": 40.0, "intra_gbps": 5.0,
               "inter_latency_us": 700.0, "inter_gbps": 0.09, "zero_rs_as_allreduce": 1.0}
    c = _cluster_of(figures, 2, 2, torch.float64, 4.0)
    assert (c.hosts, c.devices_per_host, c.dtype_bytes) == (2, 2, 8)
    assert c.device_memory_gb == 4.0
    assert c.zero_grad_collective == "allreduce"  # as the calibration prices it on gloo
    assert c.link(False) == pytest.approx((40e-6, 5.0e9 / 8))
    assert c.link(True) == pytest.approx((700e-6, 0.09e9 / 8))
    single = _cluster_of(figures, 1, 4, torch.float64, 4.0)  # one host: the all-rank fit
    assert (single.hosts, single.devices_per_host) == (1, 4)
    assert single.link(False) == pytest.approx((900e-6, 0.1e9 / 8))


_LAB_RANK = textwrap.dedent("""
    import json
    import hexagram as hx
    from hexagram.parallel.host_links import fit_host_links

    rt = hx.init(timeout=120)
    apart = fit_host_links(rt.local_world_size)
    if rt.rank == 0:
        print("RESULT " + json.dumps(apart), flush=True)
""")


@pytest.mark.skipif(unavailable_reason() is not None,
                    reason=f"network lab unavailable: {unavailable_reason()}")
@pytest.mark.netlab
@pytest.mark.timeout(300)
def test_the_shaped_network_and_the_host_are_priced_apart(tmp_path: Path) -> None:
    from hexagram.bench.lab import LabConfig, NetworkLab

    script = tmp_path / "rank.py"
    script.write_text(_LAB_RANK)
    with NetworkLab(LabConfig(hosts=2, ranks_per_host=2, bandwidth="200mbit",
                              prefix="hxt")) as lab:
        results = lab.run([sys.executable, str(script)], timeout=240)
        failed = lab.ranks_failed_message(results)
    assert not failed, failed
    (line,) = [x for x in results[0].output.splitlines() if x.startswith("RESULT ")]
    got = json.loads(line[len("RESULT "):])
    assert 0.12 < got["inter_gbps"] < 0.26, got  # the 200 Mbit/s shaping, as measured
    assert got["intra_gbps"] > 10 * got["inter_gbps"], got  # the host's loopback
