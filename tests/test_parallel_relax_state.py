"""Relaxations inside plans: the stage sync's algorithm state in checkpoints, and the config
the planner prices is the one it emits.

Multi-process (gloo CPU ranks, float64): a dp=2 stage with PowerSGD trains 8 steps without
a break, saving model, optimizer and algorithm state after step 4; a fresh process group
restores them and continues identically (1e-9), while a resume without the algorithm
state does not. Bad input: another rank's state, another algorithm config, not a state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _relax_state_worker import StateSpec, state_worker  # tests/ is on sys.path
from _relax_worker import cluster

from hexagram.errors import ConfigError
from hexagram.launch import run_local
from hexagram.parallel import Cluster, Constraints, StagePlan, gpt, plan
from hexagram.parallel.cost import Mesh
from hexagram.parallel.graph import Op
from hexagram.parallel.plans import DP_BUCKET_BYTES
from hexagram.parallel.relax import load_stage_state, stage_state
from hexagram.parallel.relax_cost import planned_options, sync_cost, wire_bytes
from hexagram.parallel.verify import ParitySpec

TOL = 1e-9


@pytest.mark.timeout(240)
def test_powersgd_stage_resumes_bit_identically_from_a_checkpoint(tmp_path: Path) -> None:
    ps = ParitySpec(model="mlp", layers=2, hidden=32, constraints={"dp": 2, "zero": False},
                    cluster=cluster(2), steps=8)
    spec = StateSpec(parity=ps, options={"rank": 2, "start_iter": 2}, save_at=4,
                     folder=str(tmp_path))
    full = run_local(state_worker, 2, args=(spec,), timeout=100)
    resumed = run_local(state_worker, 2, args=(StateSpec(**{**spec.__dict__,
                                                            "mode": "resume"}),), timeout=130)
    for f, r in zip(full, resumed):
        assert {"feedback", "compressor", "step"} <= set(r["state_keys"])
        losses, params = r["resumed"]
        assert len(params) == 4
        assert max(abs(a - b) for a, b in zip(losses, f["losses"][4:])) < TOL
        assert max((a - b).abs().max().item() for a, b in zip(params, f["params"][4:])) < TOL
        # the test can fail: without the algorithm state (Q, residuals) the run differs
        lost = r["without_algo"][1]
        assert max((a - b).abs().max().item() for a, b in zip(lost, f["params"][4:])) > 1e-6
        assert r["other_rank"].startswith("HexagramError") and "'rank'" in r["other_rank"]
        assert r["other_config"].startswith("ConfigError") and "rank=4" in r["other_config"]
        assert r["not_a_state"].startswith("HexagramError")


def _stage(**kw: object) -> StagePlan:
    return StagePlan(layers=(0, 1), ranks=[0, 1], dp=2, tp=1, latency_s=0.01,
                     memory_bytes=1e9, **kw)  # type: ignore[arg-type]


def test_stage_state_refuses_another_algorithm_or_other_parameters() -> None:
    module = torch.nn.Linear(4, 4)
    saved = stage_state(module, _stage(dp_algorithm="powersgd", dp_options={"rank": 8}))
    with pytest.raises(ConfigError, match=r"powersgd\(rank=8\).*fp16"):
        load_stage_state(module, _stage(dp_algorithm="fp16"), saved)
    with pytest.raises(ConfigError, match="same plan and model"):
        load_stage_state(torch.nn.Linear(4, 5, bias=False),
                         _stage(dp_algorithm="powersgd", dp_options={"rank": 8}), saved)


def test_planner_emits_the_powersgd_config_it_prices() -> None:
    model = gpt(layers=2, hidden=1024, heads=16, device="meta")
    x = torch.zeros(64, 256, dtype=torch.long, device="meta")
    relaxed = plan(model, x, Cluster(hosts=4, devices_per_host=8, inter_host_gbps=10),
                   Constraints(dp_algorithms=("allreduce", "powersgd")))
    emitted = [s for s in relaxed.stages if s.dp_algorithm == "powersgd"]
    assert emitted and all(s.dp_options == planned_options("powersgd") for s in emitted)
    assert all(s.dp_options == {} for s in relaxed.stages if s.dp_algorithm == "allreduce")
    assert "dp sync powersgd(rank=8,start_iter=10)" in str(relaxed)
    rank = emitted[0].dp_options["rank"]
    # priced with the same rank: the P and Q messages of a 512 x 256 gradient
    assert wire_bytes("powersgd", (512, 256), 4) == (512 * rank * 4.0, 256 * rank * 4.0)
    slow = Cluster(hosts=2, devices_per_host=1, inter_host_gbps=1, dtype_bytes=4)
    op = Op("linear", "fc", params=512 * 256, out_elems=512)
    mesh = Mesh(cluster=slow, d=2, t=1, b=1, microbatches=1, spans_hosts=True,
                dp_algorithm="powersgd")
    secs, state = sync_cost(op, 256, mesh, 1)  # state: the residual, then Q (256 x rank)
    assert state == 512 * 256 * 4 + 256 * rank * 4
    share = 512 * 256 * 4 / DP_BUCKET_BYTES  # P and Q travel bucket-wide: a latency share
    assert secs > sum(mesh.collective("allreduce", "d", b, share)
                      for b in wire_bytes("powersgd", (512, 256), 4))
