"""Re-pricing stored plans, the model-measured compute scale, ``hexagram plan
--dp-algorithms`` and ``auto``'s calibrated cluster."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest
import torch

from hexagram.cli_options import Parser
from hexagram.errors import HexagramError
from hexagram.launch import run_local
from hexagram.parallel import Cluster, Constraints
from hexagram.parallel.baselines import evaluate_fixed
from hexagram.parallel.graph import ModelGraph, capture
from hexagram.parallel.models import ResidualMLP, gpt, mlp_stack
from hexagram.parallel.overheads import scale_compute
from hexagram.parallel.planner import plan_graph
from hexagram.parallel.plans import Plan
from hexagram.parallel.relax_cost import planned_options
from hexagram.parallel.reprice import breakdown, price

#: a small CPU-like cluster whose framework overheads are all non-zero
_CLUSTER = Cluster(hosts=1, devices_per_host=4, intra_host_gbps=10, inter_host_gbps=10,
                   intra_latency_us=300, inter_latency_us=300, device_tflops=0.03,
                   memory_gbps=20, op_overhead_us=30, tp_overhead_us=2000,
                   zero_overhead_us=3000, microbatch_overhead_us=1500, step_overhead_us=500,
                   dtype_bytes=8, device_memory_gb=4)


def _gpt_graph(layers: int = 2) -> ModelGraph:
    model = gpt(layers=layers, hidden=64, heads=4, vocab=128, seq=16, device="meta",
                dtype=torch.float64)
    return capture(model, torch.zeros(16, 16, dtype=torch.long, device="meta"))


def _plans(graph: ModelGraph, cluster: Cluster) -> list[Plan]:
    cons = [Constraints(), Constraints(tp=4), Constraints(pp=2, microbatches=4),
            Constraints(pp=2, tp=2, microbatches=4), Constraints(pp=2, dp=2, microbatches=4),
            Constraints(pp=4, microbatches=8, schedule="gpipe")]
    out = [plan_graph(graph, cluster, c) for c in cons]
    fixed = [evaluate_fixed(graph, cluster, 1, 4, 1, zero=True),
             evaluate_fixed(graph, cluster, 2, 1, 2), evaluate_fixed(graph, cluster, 1, 4, 1)]
    return out + [p for p in fixed if p is not None]


@pytest.mark.parametrize("cluster", [_CLUSTER, _CLUSTER.replace(tp_overhead_us=0.0,
                                                                 zero_overhead_us=0.0),
                                     _CLUSTER.replace(cores_per_host=2.0)])
def test_reprice_reproduces_every_planned_and_hand_made_prediction(cluster: Cluster) -> None:
    graph = _gpt_graph()
    plans = _plans(graph, cluster)
    shapes = {(len(p.stages), p.stages[0].dp, p.stages[0].tp) for p in plans}
    assert len(shapes) >= 4  # pipelines, tensor and data parallel, ZeRO among them
    for p in plans:
        assert price(graph, p) == pytest.approx(p.step_time_s, rel=1e-9), p.summary()
        again = Plan.from_json(p.to_json())  # what a stored run gives back
        assert price(graph, again, cluster) == pytest.approx(p.step_time_s, rel=1e-9)


def test_reprice_reproduces_tensor_parallel_and_relaxed_plans() -> None:
    mlp = capture(mlp_stack(layers=2, hidden=2048, in_features=64, classes=10,
                            device="meta"), torch.zeros(64, 64, device="meta"))
    fast = Cluster(hosts=1, devices_per_host=4, device_memory_gb=0.5)
    tp = plan_graph(mlp, fast, Constraints(tp=4))
    assert any(v.startswith(("colwise", "rowwise")) for v in tp.stages[0].shardings.values())
    assert tp.stages[0].sharded_ops > 0  # operators on sharded activations, too
    slow = Cluster(hosts=2, devices_per_host=2, inter_host_gbps=1)
    relaxed = plan_graph(mlp, slow, Constraints(dp=4, dp_algorithms=("allreduce",
                                                                     "powersgd")))
    assert relaxed.stages[0].dp_algorithm == "powersgd"
    for p in (tp, relaxed):
        assert price(mlp, p) == pytest.approx(p.step_time_s, rel=1e-9)


def test_reprice_prices_a_stage_at_its_own_algorithm_config() -> None:
    mlp = capture(mlp_stack(layers=2, hidden=2048, in_features=64, classes=10,
                            device="meta"), torch.zeros(64, 64, device="meta"))
    slow = Cluster(hosts=2, devices_per_host=2, inter_host_gbps=1)
    planned = plan_graph(mlp, slow, Constraints(dp=4, dp_algorithms=("allreduce", "powersgd")))
    assert planned.stages[0].dp_options == planned_options("powersgd")  # rank 8
    stage = dataclasses.replace(planned.stages[0], dp_options={"rank": 1})
    rank1 = dataclasses.replace(planned, stages=[stage])
    # rank 1 sends an eighth of rank 8's factors over the 1 Gbit/s link: priced cheaper
    assert price(mlp, rank1) < price(mlp, planned) == pytest.approx(planned.step_time_s)


def test_breakdown_names_each_term() -> None:
    graph = _gpt_graph()
    pipe = plan_graph(graph, _CLUSTER, Constraints(pp=2, dp=2, microbatches=4))
    parts = breakdown(graph, pipe)
    slots = len(pipe.stages) + pipe.microbatches - 1
    assert parts["pipelining"] == pytest.approx(slots * 1500e-6)
    assert parts["step"] == pytest.approx(500e-6)
    assert parts["links"] > 0 and parts["compute"] > 0 and parts["op overhead"] > 0
    assert parts["total"] == pytest.approx(pipe.step_time_s)
    single = plan_graph(graph, _CLUSTER, Constraints(pp=1, dp=4))
    assert breakdown(graph, single)["pipelining"] == 0.0


def test_reprice_refuses_a_plan_of_another_model() -> None:
    p = plan_graph(_gpt_graph(2), _CLUSTER)
    with pytest.raises(HexagramError, match="price the plan with its own model"):
        price(_gpt_graph(3), p)


def test_scale_compute_slows_compute_only() -> None:
    graph = _gpt_graph()
    p = plan_graph(graph, _CLUSTER, Constraints(dp=4))
    base, slow = breakdown(graph, p), breakdown(graph, p, scale_compute(_CLUSTER, 3.0))
    assert slow["compute"] == pytest.approx(3 * base["compute"])
    assert slow["op overhead"] == pytest.approx(3 * base["op overhead"])
    assert slow["links"] == pytest.approx(base["links"])
    with pytest.raises(ValueError, match="factor must be > 0"):
        scale_compute(_CLUSTER, 0.0)


def _cli_args(**changes: Any) -> argparse.Namespace:
    from hexagram.parallel.cli import add_arguments

    parser = Parser(prog="hexagram plan")
    add_arguments(parser)
    argv = ["--model", "gpt", "--layers", "2", "--width", "1024", "--heads", "16",
            "--seq", "256", "--global-batch", "64", "--cluster", "4x8", "--inter-gbps", "10"]
    for k, v in changes.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return parser.parse_args(argv)


def test_cli_dp_algorithms_refuses_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:

    with pytest.raises(SystemExit) as exit_info:
        _cli_args(dp_algorithms="fp16,bogus")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "'bogus' not priced" in err and "powersgd" in err and "topk" in err


def test_cli_dp_algorithms_lets_the_planner_compress_slow_dp(
        capsys: pytest.CaptureFixture[str]) -> None:
    from hexagram.parallel.cli import constraints, run

    assert constraints(_cli_args(dp_algorithms="powersgd")).dp_algorithms == (
        "allreduce", "powersgd")
    assert constraints(_cli_args()).dp_algorithms == ("allreduce",)
    assert run(_cli_args(dp_algorithms="fp16,powersgd")) == 0
    assert "dp sync powersgd" in capsys.readouterr().out


def _measure_worker() -> dict[str, Any]:
    import hexagram.parallel as hp
    from hexagram.parallel.auto import measure_cluster
    from hexagram.parallel.overheads import model_compute_scale

    torch.manual_seed(0)
    model = ResidualMLP(12, 32, 5, blocks=2).double()
    x = torch.randn(16, 12, dtype=torch.float64)
    plain = measure_cluster(torch.float64)
    figs = model_compute_scale(model, x, None, plain)
    grads = [p.grad is None for p in model.parameters()]
    pm = hp.auto(model, x)
    return {"plain": plain, "figs": figs, "report": pm.report, "grads": grads}


@pytest.mark.timeout(300)
def test_auto_prices_with_the_calibration_and_the_models_own_step() -> None:
    results = run_local(_measure_worker, 2, timeout=280)
    first = results[0]
    for r in results:  # every rank plans with the same measured figures
        assert r["plain"] == first["plain"] and r["figs"] == first["figs"]
        assert "overheads DTensor" in r["report"] and "pipelining" in r["report"]
        assert all(r["grads"])  # the timing steps leave no gradients behind
    assert first["plain"].step_overhead_us > 0  # measured, not the default of 0
    figs = first["figs"]
    assert figs["model_step_ms"] > 0 and figs["model_predicted_ms"] > 0
    assert figs["model_step_alone_ms"] > 0
    assert figs["compute_scale"] == pytest.approx(figs["model_step_ms"]
                                                  / figs["model_predicted_ms"])
    # the whole batch per rank timed too: the scale split into rate and per-operator parts
    assert figs["model_step_whole_batch_ms"] > 0
    assert figs["work_scale"] > 0 and figs["op_scale"] >= 0


@pytest.mark.timeout(600)
def test_cli_execute_calibrates_with_the_models_step(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    from hexagram.parallel.cli import add_arguments, run

    parser = Parser(prog="hexagram plan")
    add_arguments(parser)
    args = parser.parse_args(["--model", "gpt", "--layers", "2", "--width", "32", "--heads",
                              "4", "--vocab", "64", "--seq", "16", "--global-batch", "8",
                              "--cluster", "1x2", "--execute", "--steps", "2"])
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "Plan for 1x2 devices" in out and "measured" in out and "ratio" in out
