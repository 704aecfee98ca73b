"""Relaxations inside plans: a stage's dp gradient sync by a Hexagram algorithm.

Multi-process tiers (gloo CPU ranks, float64): the algorithm path with ``allreduce`` equals
the existing sync (data parallel, ZeRO, tensor parallel stages); a stage with PowerSGD gets
exactly the gradients of ``hexagram.DistributedDataParallel(algorithm="powersgd")`` on the
same ranks; a pipeline of dp=2 stages with PowerSGD trains (loss falls, replicas agree).
Single-process: plan JSON round trips, the planner's option, bad input.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from _relax_worker import RelaxSpec, cluster, relax_worker  # tests/ is on sys.path

from hexagram.errors import ConfigError
from hexagram.launch import run_local
from hexagram.parallel import Cluster, Constraints, Plan, StagePlan, gpt, plan
from hexagram.parallel.verify import ParitySpec

TOL = 1e-6


def _run(spec: RelaxSpec, world: int, timeout: float = 150) -> list[dict]:
    return run_local(relax_worker, world, args=(spec,), timeout=timeout)


@pytest.mark.timeout(180)
def test_allreduce_through_algorithm_path_matches_existing_sync() -> None:
    # no ZeRO: the planner may shard this tiny MLP with FSDP2, and then no gradient would
    # take the path
    ps = ParitySpec(model="mlp", layers=2, hidden=16, constraints={"dp": 2, "zero": False},
                    cluster=cluster(2))
    for r in _run(RelaxSpec(parity=ps), 2):
        assert r["loss_diff"] < TOL and r["grad_diff"] < TOL and r["param_diff"] < TOL
        assert r["bytes_sent"] > 0  # the algorithm path ran (it counts its bytes)


@pytest.mark.timeout(180)
def test_algorithm_path_with_zero_stage_matches_existing_sync() -> None:
    # 100 kB per device: the planner shards with ZeRO; FSDP2 keeps those parameters, the
    # algorithm syncs the rest
    ps = ParitySpec(model="mlp", layers=2, hidden=16, constraints={"dp": 2},
                    cluster=cluster(2, device_memory_gb=1e-4))
    results = _run(RelaxSpec(parity=ps, algorithm="allreduce"), 2)
    assert any(k.endswith("+zero") for k in
               json.loads(results[0]["plan"])["stages"][0]["shardings"].values())
    for r in results:
        assert r["grad_diff"] < TOL and r["param_diff"] < TOL


@pytest.mark.timeout(240)
def test_algorithm_path_with_tensor_parallel_stage_matches_existing_sync() -> None:
    ps = ParitySpec(model="mlp", layers=2, hidden=16,
                    constraints={"dp": 2, "tp": 2, "zero": False},  # see the first test
                    cluster=cluster(4, device_tflops=1e-6, op_overhead_us=0.0))
    results = _run(RelaxSpec(parity=ps, algorithm="allreduce"), 4, timeout=200)
    stage = json.loads(results[0]["plan"])["stages"][0]
    assert stage["tp"] == 2 and "colwise" in stage["shardings"].values()
    for r in results:
        assert r["grad_diff"] < TOL and r["param_diff"] < TOL


@pytest.mark.timeout(180)
def test_powersgd_stage_equals_hexagram_ddp_powersgd() -> None:
    ps = ParitySpec(model="mlp", layers=2, hidden=32, constraints={"dp": 2, "zero": False},
                    cluster=cluster(2), steps=6)
    opts = {"rank": 2, "start_iter": 1}  # one allreduce step, then compressed
    results = _run(RelaxSpec(parity=ps, algorithm="powersgd", options=opts, compare="ddp"), 2)
    for r in results:
        assert r["grad_diff"] < TOL and r["replica_diff"] < TOL
    # compressed: fewer bytes than a plain allreduce of the same steps sends
    dense = _run(RelaxSpec(parity=ps, algorithm="allreduce", compare="none"), 2)
    assert results[0]["bytes_sent"] < dense[0]["bytes_sent"]


@pytest.mark.timeout(300)
def test_pipeline_of_powersgd_stages_trains_and_replicas_agree() -> None:
    ps = ParitySpec(model="gpt", layers=2, hidden=32, vocab=16, seq=8, batch=16, steps=12,
                    lr=0.5, constraints={"pp": 2, "dp": 2, "microbatches": 2},
                    cluster=cluster(4))
    spec = RelaxSpec(parity=dataclasses.replace(ps, seed=0), algorithm="powersgd",
                     options={"rank": 2, "start_iter": 0}, compare="none")
    results = _run(spec, 4, timeout=260)
    stages = json.loads(results[0]["plan"])["stages"]
    assert [s["dp"] for s in stages] == [2, 2]
    assert all(s["dp_algorithm"] == "powersgd" for s in stages)
    for r in results:
        assert r["replica_diff"] < TOL and r["bytes_sent"] > 0
    losses = [r["losses"] for r in results if r["losses"][0] is not None]
    assert losses and all(run[-1] < run[0] for run in losses)


# -- single process ---------------------------------------------------------------------

def _stage(**kw: object) -> StagePlan:
    return StagePlan(layers=(0, 2), ranks=[0, 1], dp=2, tp=1, latency_s=0.01,
                     memory_bytes=1e9, **kw)  # type: ignore[arg-type]


def test_plan_json_round_trip_keeps_dp_algorithm_and_reads_old_plans() -> None:
    p = Plan(cluster=Cluster(hosts=1, devices_per_host=2), microbatches=1, global_batch=8,
             step_time_s=0.01, stages=[_stage(dp_algorithm="powersgd",
                                              dp_options={"rank": 4})])
    assert Plan.from_json(p.to_json()) == p
    assert "dp sync powersgd(rank=4)" in str(p)
    old = json.loads(p.to_json())
    for s in old["stages"]:
        del s["dp_algorithm"], s["dp_options"]
    assert Plan.from_json(json.dumps(old)).stages[0].dp_algorithm == "allreduce"


def test_unknown_algorithm_lists_valid_names() -> None:
    with pytest.raises(ConfigError, match=r"not registered: valid are .*did you mean 'powersgd'"):
        _stage(dp_algorithm="powersdg")


@pytest.mark.parametrize("name", ["local_sgd", "diloco", "async", "decentralized"])
def test_weight_algorithms_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="averages weights after optimizer steps"):
        _stage(dp_algorithm=name)


@pytest.mark.parametrize("name, options, match", [
    ("auto", {}, "measures compute"), ("qadam", {}, "hooks the optimizer"),
    ("powersgd", {"delay": 1}, "delay"), ("topk", {"hierarchical": True}, "hierarchical"),
    ("powersgd", {"rank": 0}, "rank")])
def test_unusable_algorithms_and_options_are_refused(name: str, options: dict,
                                                     match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _stage(dp_algorithm=name, dp_options=options)


def test_constraints_refuse_unpriced_or_unusable_algorithms() -> None:
    with pytest.raises(ConfigError, match="averages weights"):
        Constraints(dp_algorithms=("allreduce", "local_sgd"))
    with pytest.raises(ConfigError, match="priced"):
        Constraints(dp_algorithms=("allreduce", "qsgd"))


def _gpt_plan(cons: Constraints) -> Plan:
    """GPT (2 blocks, hidden 1024, GPT-2's vocabulary) on 4 hosts x 8 devices, 10 Gbit/s
    between hosts."""
    model = gpt(layers=2, hidden=1024, heads=16, device="meta")
    x = torch.zeros(64, 256, dtype=torch.long, device="meta")
    return plan(model, x, Cluster(hosts=4, devices_per_host=8, inter_host_gbps=10), cons)


def test_planner_keeps_allreduce_unless_allowed_and_compresses_slow_dp() -> None:
    default = _gpt_plan(Constraints())
    assert all(s.dp_algorithm == "allreduce" for s in default.stages)
    relaxed = _gpt_plan(Constraints(dp_algorithms=("allreduce", "fp16", "powersgd")))
    # the dp sync that crosses hosts is compressed, and the plan is predicted faster
    crossing = [s for s in relaxed.stages if s.dp * s.tp > 8]
    assert crossing and all(s.dp_algorithm == "powersgd" for s in crossing)
    assert relaxed.step_time_s < default.step_time_s


def test_wire_bytes_follow_the_payload_formats() -> None:
    from hexagram.parallel.relax_cost import wire_bytes

    n = 512 * 256
    assert wire_bytes("allreduce", (512, 256), 4) == (4.0 * n,)
    assert wire_bytes("fp16", (512, 256), 4) == (2.0 * n,)
    rank = 8  # the planner's PowerSGD config (relax_cost.PLANNED_OPTIONS), not the default 2
    assert wire_bytes("powersgd", (512, 256), 4) == (512 * rank * 4.0, 256 * rank * 4.0)
    assert wire_bytes("powersgd", (512,), 4) == (4.0 * 512,)  # vectors go dense
    k = math.ceil(0.02 * n)  # top-k's default density: values + int32 indices
    assert wire_bytes("topk", (512, 256), 4) == (8.0 * k,)
