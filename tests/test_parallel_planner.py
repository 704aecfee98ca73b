"""Single-process tests of the planner: validation, capture, cost model, ILP, DP, plans."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from hexagram.cli_options import Parser
from hexagram.errors import ConfigError
from hexagram.parallel import (
    Cluster,
    Constraints,
    NoPlanFitsError,
    Plan,
    baselines,
    capture,
    gpt,
    mlp_stack,
    plan,
    plan_graph,
)
from hexagram.parallel import cli as plan_cli
from hexagram.parallel.cost import Mesh, edge_cost, strategies
from hexagram.parallel.graph import Layer, ModelGraph
from hexagram.parallel.inter import Tables, build_tables, solve
from hexagram.parallel.intra import evaluate, fastest, layer_options, megatron


def _mlp_graph(hidden: int = 64, layers: int = 2, batch: int = 16) -> ModelGraph:
    m = mlp_stack(layers=layers, hidden=hidden, in_features=8, classes=4, device="meta")
    return capture(m, torch.zeros(batch, 8, device="meta"))


def _gpt_graph(layers: int = 4, hidden: int = 256, batch: int = 32) -> ModelGraph:
    m = gpt(layers=layers, hidden=hidden, heads=8, vocab=1000, seq=128, device="meta")
    return capture(m, torch.zeros(batch, 128, dtype=torch.long, device="meta"))


# --- input validation ---------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "name"), [
    ({"devices_per_host": 6}, "devices_per_host"), ({"hosts": 0}, "hosts"),
    ({"inter_host_gbps": 0.0}, "inter_host_gbps"), ({"device_memory_gb": -1.0},
                                                    "device_memory_gb")])
def test_cluster_errors_name_the_field(fields: dict, name: str) -> None:
    with pytest.raises(ConfigError, match=f"Cluster.{name}"):
        Cluster(**fields)


def test_constraints_must_multiply_to_the_devices() -> None:
    cluster = Cluster(hosts=2, devices_per_host=4)
    with pytest.raises(ConfigError, match="pp\\*tp\\*dp = 12 but the cluster has 8"):
        Constraints(pp=3, tp=2, dp=2).validate(cluster)
    with pytest.raises(ConfigError, match=r"Constraints\.tp=8 exceeds Cluster\.devices_per_host"):
        Constraints(tp=8).validate(cluster)
    with pytest.raises(ConfigError, match="HOSTSxDEVICES"):
        Cluster.parse("eight")


# --- capture ------------------------------------------------------------------------------

def test_capture_groups_layers_and_counts_flops() -> None:
    g = _mlp_graph(hidden=64, batch=16)
    assert [layer.name for layer in g.layers] == ["0", "1", "2", "3"]
    fc1 = g.layers[1].ops[1]
    assert (fc1.kind, fc1.target, fc1.params) == ("linear", "1.fc1", 64 * 256 + 256)
    assert fc1.flops == 2 * 64 * 256 and fc1.out_elems == 256   # per sample
    assert g.params == sum(p.numel() for p in mlp_stack(2, 64, 8, 4).parameters())


def test_unknown_operator_is_replicated_with_a_warning() -> None:
    m = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Unflatten(1, (2, 4)),
                                                     nn.Conv1d(2, 2, 3, padding=1),
                                                     nn.Flatten()), nn.Linear(8, 2))
    with pytest.warns(UserWarning, match="Conv1d"):
        g = capture(m, torch.zeros(3, 4))
    mesh = Mesh(cluster=Cluster(hosts=1, devices_per_host=2), d=1, t=2, b=1, microbatches=1)
    conv = g.layers[1].ops[2]
    assert conv.kind == "unknown"
    assert [s.name for s in strategies(g.layers[1], 2, mesh)] == ["replicate"]


# --- cost model ---------------------------------------------------------------------------

def test_collective_costs_follow_the_alpha_beta_formulas() -> None:
    c = Cluster(hosts=2, devices_per_host=4, intra_host_gbps=800, inter_host_gbps=80,
                intra_latency_us=10, inter_latency_us=30)
    mesh = Mesh(cluster=c, d=2, t=4, b=1, microbatches=1, spans_hosts=True)
    x = 4e6
    assert mesh.collective("allreduce", "t", x) == pytest.approx(6 * 10e-6 + 1.5 * x / 100e9)
    assert mesh.collective("allgather", "t", x) == pytest.approx(3 * 10e-6 + 0.75 * x / 100e9)
    # d crosses hosts; the 4 tensor-parallel rings share each host's 10 GB/s NIC
    assert mesh.collective("allreduce", "d", x) == pytest.approx(2 * 30e-6 + x / (10e9 / 4))
    assert edge_cost("P", "R", 1e6, mesh) == mesh.collective("allreduce", "t", 2e6)
    assert edge_cost("S", "S", 1e6, mesh) == 0.0


# --- intra-op ILP -------------------------------------------------------------------------

def _brute_force(layer: Layer, mesh: Mesh) -> float:
    """Least time over all executable assignments (same rules as the ILP)."""
    cands = [strategies(layer, i, mesh) for i in range(len(layer.ops))]
    best = math.inf
    for picks in itertools.product(*cands):
        ops = layer.ops
        if ops[-1].kind != "linear" and picks[-1].out_layout != "R":
            continue
        if any(ops[u].kind != "linear" and op.kind != "linear"
               and picks[u].out_layout != picks[v].in_layout
               for v, op in enumerate(ops) for u in op.inputs):
            continue
        best = min(best, evaluate(layer, mesh, list(picks)).time)
    return best


@pytest.mark.parametrize(("d", "t", "hidden"), [(1, 4, 4096), (2, 2, 512), (4, 1, 64)])
def test_ilp_matches_exhaustive_search(d: int, t: int, hidden: int) -> None:
    layer = _mlp_graph(hidden=hidden).layers[1]
    mesh = Mesh(cluster=Cluster(hosts=1, devices_per_host=4), d=d, t=t, b=8, microbatches=2)
    assert fastest(layer, mesh).time == pytest.approx(_brute_force(layer, mesh), rel=1e-9)


def test_ilp_finds_megatron_on_a_wide_block_and_respects_memory() -> None:
    layer = _mlp_graph(hidden=8192).layers[1]
    mesh = Mesh(cluster=Cluster(hosts=1, devices_per_host=8), d=2, t=4, b=4, microbatches=1)
    best = fastest(layer, mesh)
    assert [s.name for s in best.picks[1:4]] == ["colwise", "sharded", "rowwise"]
    assert best.time <= megatron(layer, mesh).time + 1e-15
    opts = layer_options(layer, mesh)
    mems = [o.state + o.act for o in opts]
    assert mems == sorted(mems, reverse=True) and len(opts) >= 2
    assert [o.time for o in opts] == sorted(o.time for o in opts)
    assert any(s.zero for s in opts[-1].picks)  # the smallest option shards over dp


# --- inter-op DP --------------------------------------------------------------------------

def _brute_pipeline(tables: Tables, devices: int) -> float:
    """Enumerate every contiguous partition and submesh per stage."""
    n_layers, b, best = tables.cost.shape[-1] - 1, tables.microbatches, math.inf
    for cuts in range(n_layers):
        for bounds in itertools.combinations(range(1, n_layers), cuts):
            edges = [0, *bounds, n_layers]
            s = len(edges) - 1
            for subs in itertools.product(range(len(tables.subs)), repeat=s):
                if sum(tables.subs[k].devices for k in subs) != devices:
                    continue
                lat = [tables.cost[min(s - k, len(tables.inflight)) - 1, subs[k], edges[k],
                                   edges[k + 1]] for k in range(s)]
                best = min(best, sum(lat) + (b - 1) * max(lat))
    return best


@pytest.mark.parametrize("microbatches", [1, 4])
def test_stage_dp_matches_exhaustive_search(microbatches: int) -> None:
    graph = _gpt_graph(layers=3, hidden=128, batch=8)
    cluster = Cluster(hosts=1, devices_per_host=4, device_memory_gb=1)
    tables = build_tables(graph, cluster, Constraints(), microbatches, {})
    found = solve(tables, 4, list(range(1, 5)), eps=0.0)
    assert found is not None
    assert found[0] == pytest.approx(_brute_pipeline(tables, 4), rel=1e-9)


# --- plans --------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["1x4", "2x4"])
def test_planner_is_never_worse_than_hand_made_strategies(spec: str) -> None:
    graph = _gpt_graph(layers=4, hidden=512, batch=32)
    cluster = Cluster.parse(spec, inter_host_gbps=25, device_memory_gb=4)
    p = plan_graph(graph, cluster)
    assert p.memory_bytes <= cluster.memory_bytes and p.devices == cluster.devices
    for base in baselines(graph, cluster):
        if base.plan is not None:
            assert p.step_time_s <= base.plan.step_time_s * (1 + 1e-9), base.name


def test_model_larger_than_a_device_gets_a_plan_that_fits() -> None:
    graph = _mlp_graph(hidden=2048, layers=4, batch=64)
    need = graph.params * 16 / 1e9                       # bf16 params+grads, fp32 Adam
    cluster = Cluster(hosts=1, devices_per_host=8, device_memory_gb=need / 3)
    p = plan_graph(graph, cluster)
    assert p.memory_bytes <= cluster.memory_bytes
    too_small = cluster.replace(device_memory_gb=need / 100)
    with pytest.raises(NoPlanFitsError, match=r"needs at least [\d.]+ GB per device, devices "
                                              r"have [\d.e-]+ GB"):
        plan_graph(graph, too_small)


def test_plan_prints_and_round_trips_through_json() -> None:
    m = mlp_stack(layers=2, hidden=32, in_features=8, classes=4, device="meta")
    p = plan(m, torch.zeros(8, 8, device="meta"), cluster=Cluster(hosts=1, devices_per_host=2),
             constraints=Constraints(pp=2, microbatches=2))
    text = str(p)
    assert "stage 0" in text and "stage 1" in text and "ms/step" in text
    back = Plan.from_json(p.to_json())
    assert back == p and json.loads(p.to_json())["stages"][1]["ranks"] == [1]


def test_cli_writes_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = Parser(prog="hexagram plan")
    plan_cli.add_arguments(parser)
    out = tmp_path / "plan.json"
    args = parser.parse_args(["--model", "gpt", "--layers", "2", "--width", "128", "--seq",
                              "64", "--vocab", "500", "--cluster", "1x2", "--json", str(out)])
    assert plan_cli.run(args) == 0
    assert Plan.from_json(out.read_text()).devices == 2
    bad = parser.parse_args(["--cluster", "1x3"])
    assert plan_cli.run(bad) == 2
    assert "devices_per_host" in capsys.readouterr().err


def test_cli_takes_simulates_presets(capsys: pytest.CaptureFixture[str]) -> None:
    """``hexagram plan --intra/--inter/--device`` plans for the hardware ``hexagram simulate``
    describes with the same names: the cluster equals Cluster.from_presets."""
    parser = Parser(prog="hexagram plan")
    plan_cli.add_arguments(parser)
    args = parser.parse_args(["--cluster", "2x4", "--intra", "nvlink", "--inter", "25gbe",
                              "--device", "h100"])
    want = Cluster.from_presets(2, 4, intra="nvlink", inter="25gbe", device="h100")
    assert plan_cli.cluster_of(args) == want
    assert want.inter_host_gbps == 25.0 and want.device_memory_gb == 80.0
    half = parser.parse_args(["--cluster", "1x2", "--intra", "nvlink"])
    assert plan_cli.run(half) == 2
    assert "--intra and --inter go together" in capsys.readouterr().err
    with pytest.raises(SystemExit) as unknown:  # a preset is checked as it is parsed
        parser.parse_args(["--cluster", "1x2", "--intra", "nvlink", "--inter", "fibre"])
    err = capsys.readouterr().err
    assert unknown.value.code == 2 and err.count("\n") == 1
    assert "unknown link preset 'fibre'" in err
