"""Every plan the planner emits executes, stages of different dp x tp shapes included.

Heterogeneous stage meshes are linked by cross-mesh resharding of activations and their
gradients (hexagram.parallel.crossmesh, hexagram.parallel.hetero). On 4 gloo CPU ranks in
float64, 5 SGD steps of each plan match the single-process model (loss, gradients and final
parameters within 1e-6): stage meshes 2x1 -> 1x2, 1 rank -> 3 ranks (ZeRO-sharded with
FSDP2), an fx-traced residual model, a tensor independent of the batch crossing a boundary,
and a three-stage plan of different sizes the planner chose by itself.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from _parallel_parity import build, joined, many, zero  # tests/ is on sys.path under pytest

from hexagram.errors import HexagramError
from hexagram.launch import run_local
from hexagram.parallel import Cluster, Constraints, Plan, plan
from hexagram.parallel.apply import check_executable, is_heterogeneous
from hexagram.parallel.hetero import order
from hexagram.parallel.split import Boundary, boundaries
from hexagram.parallel.verify import ParitySpec

TOL = 1e-6


def _compute_bound(world: int) -> Cluster:
    return Cluster(hosts=1, devices_per_host=world, device_tflops=1e-6, dtype_bytes=8,
                   op_overhead_us=0.0)


def _two_shapes(spec: ParitySpec, first: dict[str, int], second: dict[str, int]) -> Plan:
    """Stage 0 of a pp=2 plan under ``first``, stage 1 of one under ``second`` (same split)."""
    model, x, _ = build(spec)
    a, b = (plan(model, x, _compute_bound(4), Constraints(pp=2, microbatches=2, **c))
            for c in (first, second))
    assert [s.layers for s in a.stages] == [s.layers for s in b.stages]
    return joined([a.stages[0], b.stages[1]], a)


def _one_to_three(spec: ParitySpec) -> Plan:
    """Stage 0 on one rank, stage 1 on three data-parallel ranks, ZeRO-sharded (FSDP2)."""
    model, x, _ = build(spec)
    p = plan(model, x, Cluster(hosts=1, devices_per_host=2, dtype_bytes=8),
             Constraints(pp=2, microbatches=2))
    return joined([p.stages[0], dataclasses.replace(zero(p.stages[1]), dp=3)], p)


def _check(jobs: list[tuple[ParitySpec, str, int]], ranks: list[list[dict[str, Any]]]
           ) -> None:
    for k, (spec, plan_json, _zero) in enumerate(jobs):
        rows = [r[k] for r in ranks]
        for r in rows:
            assert r["grad_diff"] < TOL and r["param_diff"] < TOL and r["loss_diff"] < TOL, \
                (spec.model, Plan.from_json(plan_json).summary(), r)
        stages = Plan.from_json(plan_json).stages
        assert {r["stage"] for r in rows} == set(range(len(stages)))
        assert sum(r["losses"][-1] is not None for r in rows) == len(stages[-1].ranks)


@pytest.mark.timeout(300)
def test_heterogeneous_stage_meshes_match_single_process() -> None:
    gpt = ParitySpec(model="gpt", layers=2, hidden=16)
    mlp = ParitySpec(model="mlp", layers=2, hidden=16, batch=12)
    res = ParitySpec(model="residual", layers=2, hidden=16)
    plans = [_two_shapes(gpt, {"dp": 2}, {"tp": 2}),
             dataclasses.replace(_one_to_three(mlp), schedule="gpipe"),
             _two_shapes(res, {"tp": 2}, {"dp": 2})]
    assert [p.schedule for p in plans] == ["1f1b", "gpipe", "1f1b"]
    shapes = [[(s.dp, s.tp) for s in p.stages] for p in plans]
    assert shapes == [[(2, 1), (1, 2)], [(1, 1), (3, 1)], [(1, 2), (2, 1)]]
    assert "colwise" in plans[0].stages[1].shardings.values()
    assert all(v.endswith("+zero") for v in plans[1].stages[1].shardings.values())
    jobs = [(s, p.to_json(), 3) for s, p in zip((gpt, mlp, res), plans)]
    _check(jobs, run_local(many, 4, args=(jobs,), timeout=280))


def _planner_heterogeneous() -> tuple[ParitySpec, Plan]:
    spec = ParitySpec(model="residual", layers=4, hidden=16)
    model, x, _ = build(spec)
    cluster = Cluster(hosts=2, devices_per_host=2, inter_host_gbps=0.1, dtype_bytes=8,
                      device_memory_gb=1.0, op_overhead_us=0.0)
    return spec, plan(model, x, cluster, Constraints(microbatches=4))


@pytest.mark.timeout(300)
def test_batch_independent_tensor_and_planner_chosen_stages_match_single_process() -> None:
    pos = ParitySpec(model="positional", batch=6)
    one_three = _one_to_three(pos)
    spec, chosen = _planner_heterogeneous()
    # today 1x1+1x1+1x2 (three stages, two sizes); any heterogeneous choice must run
    assert is_heterogeneous(chosen), chosen.summary()
    jobs = [(pos, one_three.to_json(), 3), (spec, chosen.to_json(), 3)]
    _check(jobs, run_local(many, 4, args=(jobs,), timeout=280))


def test_boundaries_tell_batch_rows_from_batch_independent_tensors() -> None:
    # batch 4 and a 4 x 16 position tensor: the shapes alone cannot tell them apart
    model, x, _ = build(ParitySpec(model="positional", batch=4))
    p = plan(model, x, Cluster(hosts=1, devices_per_host=2, dtype_bytes=8),
             Constraints(pp=2, microbatches=2))
    (crossing,) = boundaries(model, x, p)
    assert sorted(crossing, key=lambda b: b.batch) == [
        Boundary((4, 16), crossing[0].dtype, False), Boundary((4, 16), crossing[0].dtype, True)]


PLANNED = [
    (Cluster(hosts=2, devices_per_host=2, inter_host_gbps=0.1, dtype_bytes=8,
             op_overhead_us=0.0), [Constraints(), Constraints(microbatches=4)]),
    (Cluster(hosts=2, devices_per_host=2, dtype_bytes=8, device_memory_gb=1e-4,
             inter_host_gbps=0.1), [Constraints(pp=2, microbatches=4)]),
    (Cluster(hosts=1, devices_per_host=4, dtype_bytes=8), [Constraints()]),
    (_compute_bound(4), [Constraints(pp=2)]),
]


@pytest.mark.timeout(300)
def test_every_plan_the_planner_emits_is_executable() -> None:
    emitted = []
    for (cluster, cons), name in itertools.product(
            [(c, k) for c, ks in PLANNED for k in ks], ("mlp", "residual")):
        model, x, _ = build(ParitySpec(model=name, layers=4, hidden=16))
        p = plan(model, x, cluster, cons)
        check_executable(model, p, cluster.devices, x)  # raises if the executor refuses
        emitted.append(p)
    # the grid does reach plans with stage meshes of different shapes and sizes
    # (today 2 of 10 plans: 1x1+1x1+1x2 for both models on the slow 2x2)
    assert any(is_heterogeneous(p) for p in emitted), [p.summary() for p in emitted]


def test_heterogeneous_plan_without_example_inputs_names_the_fix() -> None:
    spec, chosen = _planner_heterogeneous()
    model = build(spec)[0]
    with pytest.raises(HexagramError, match="example_inputs"):
        check_executable(model, chosen, 4)
    with pytest.raises(HexagramError, match="plan is for 4 devices but 2 ranks run"):
        check_executable(model, chosen, 2, example_inputs=build(spec)[1])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedule_order_runs_each_micro_batch_forward_then_backward(schedule: str) -> None:
    for stages, micro in itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 8)):
        for index in range(stages):
            steps = order(stages, index, micro, schedule)
            assert sorted(steps) == sorted([("F", m) for m in range(micro)]
                                           + [("B", m) for m in range(micro)])
            assert all(steps.index(("F", m)) < steps.index(("B", m)) for m in range(micro))
            live, peak = 0, 0
            for kind, _m in steps:
                live += 1 if kind == "F" else -1
                peak = max(peak, live)
            # 1F1B keeps at most (stages - index) micro-batches in flight; GPipe all of them
            assert peak == (micro if schedule == "gpipe" else min(stages - index, micro))
