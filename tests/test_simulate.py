"""hexagram simulate: consistency with cost.model, hand-computed networks and scaling, CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from hexagram.auto.choose import make
from hexagram.auto.simulate import simulate
from hexagram.cli import main
from hexagram.cost.devices import DEVICES, LINKS, Device, device, link
from hexagram.cost.model import MB, predict_any
from hexagram.cost.probe import NetworkProfile
from hexagram.cost.profile import CompressorCost
from hexagram.cost.simulate import (
    Cluster,
    device_compute,
    module_tensors,
    params_compute,
    params_tensors,
    reference_tensors,
)
from hexagram.errors import ConfigError

N = 2_000_000  # parameters of the test model: 8 layers of 500x500
COMPUTE = params_compute(N, layers=8, dev="h100", samples=64)
COST = CompressorCost((1e-5, 1e-9), (1e-5, 5e-10))


def _row(rows, label, world):
    return next(r for r in rows if r.label == label and r.world == world)


@pytest.mark.parametrize("world", [4, 16])
@pytest.mark.parametrize("label", ["allreduce", "fp16", "topk", "gtopk", "powersgd",
                                   "qsgd", "local_sgd", "decentralized"])
def test_simulate_equals_cost_model_on_the_same_network(label: str, world: int) -> None:
    cluster = Cluster(devices_per_host=8, inter="10gbe", backend="gloo")  # rings: linear fits
    rows = simulate([label], [world], COMPUTE, cluster, costs={label: COST})
    # a plain NetworkProfile (what a probe would have written) with the simulator's fits;
    # gTop-k's butterfly (cross-host rounds share the uplink) has no linear fit: its own
    net = NetworkProfile.from_json(json.loads(json.dumps(cluster.network(world).to_json())))
    if label == "gtopk":
        net = cluster.network(world)
    want = predict_any(make(label), COMPUTE, net, {label: COST}, label=label,
                       bucket_bytes=25 * MB)
    got = rows[0]
    assert got.step_s == pytest.approx(want.step_s, rel=1e-12)
    assert got.bytes == want.wire_bytes
    assert got.exposed_s == pytest.approx(want.exposed_s, abs=1e-15)
    assert got.compress_s == pytest.approx(want.compress_s)


def test_network_fits_by_hand() -> None:
    net = Cluster(devices_per_host=8, inter="25gbe").network(64)
    assert (net.world, net.hosts) == (64, 8)
    ar = net.fit("allreduce")
    assert ar.rate_bps == 25e9 / 8  # ring limited by the host uplink
    # the ring's 2 (P-1) hops: 2 (P-H) inside hosts (NVLink 3 us), 2 (H-1) across (20 us)
    assert ar.latency_s == pytest.approx(2 * 56 * 3e-6 + 2 * 7 * 20e-6)
    assert net.fit("allgather").latency_s == pytest.approx(56 * 3e-6 + 7 * 20e-6)
    # NCCL picks the tree for a small message: 2 (7 * 3 us + log2(8) * 20 us) + 2 n / 0.9 B
    n = 6400
    assert ar.time(2 * 63 * n // 64) == pytest.approx(2 * (7 * 3e-6 + 3 * 20e-6)
                                                      + 2 * n / (0.9 * 3.125e9))
    # all-to-all: 8 ranks push 8*56/64 of their data off the host at once
    assert net.fit("alltoall").rate_bps == pytest.approx((63 / 64) / (8 * 56 / (64 * 3.125e9)))
    # hierarchical: leader sends 7 n + 2*7/8 n in 2*7 n / 450e9 + (2*7/8) n / 3.125e9 s
    h = net.fit("hierarchical")
    assert h.rate_bps == pytest.approx((7 + 14 / 8) / (14 / 450e9 + (14 / 8) / 3.125e9),
                                       rel=1e-3)  # its JSON figure, latency left out
    n = 64 * 10**6  # 64 MB: 2 (3 us + 7 n / 450e9) in the host, leaders' ring at 3.125e9
    assert h.time(int((7 + 14 / 8) * n)) == pytest.approx(
        2 * (3e-6 + 7 * n / 450e9) + 2 * 7 * 20e-6 + 14 / 8 * n / 3.125e9)
    one_host = Cluster(devices_per_host=8).network(8)
    assert one_host.hosts == 1 and one_host.fit("allreduce").rate_bps == 450e9
    with pytest.raises(ConfigError, match="backend"):
        Cluster(backend="ucx")
    slow = Cluster(devices_per_host=8, inter="25gbe", oversubscription=2.0).network(64)
    assert slow.fit("allreduce").rate_bps == pytest.approx(ar.rate_bps / 2)
    wide = Cluster(devices_per_host=8, inter="25gbe", inter_links=4).network(64)
    assert wide.fit("allreduce").rate_bps == pytest.approx(4 * ar.rate_bps)


def test_allreduce_bytes_tend_to_twice_the_model() -> None:
    worlds = [8, 64, 512, 4096]
    rows = simulate(["allreduce"], worlds, COMPUTE, Cluster())
    model_bytes = 4 * sum(t.numel for t in COMPUTE.tensors)
    ratios = [r.bytes / model_bytes for r in rows]
    for p, ratio in zip(worlds, ratios):
        assert ratio == pytest.approx(2 * (p - 1) / p, rel=1e-5)
    assert ratios == sorted(ratios) and 1.99 < ratios[-1] < 2.0


def test_topk_grows_linearly_in_p_gtopk_with_log_p() -> None:
    worlds = [8, 64, 512, 4096]
    rows = simulate(["topk", "gtopk"], worlds, COMPUTE, Cluster())
    topk = [_row(rows, "topk", p).bytes for p in worlds]
    gtopk = [_row(rows, "gtopk", p).bytes for p in worlds]
    for p, b in zip(worlds, topk):
        assert b == pytest.approx(topk[0] * (p - 1) / 7, rel=1e-9)  # (P-1) payloads
    for p, b in zip(worlds, gtopk):  # butterfly: log2 P rounds of k pairs (and an 8-byte
        # fault allreduce per step: bytes beside megabytes, within rel 1e-4)
        assert b == pytest.approx(gtopk[0] * math.log2(p) / 3, rel=1e-4)
    assert gtopk[-1] < topk[-1] / 100


def test_monotonic_in_bandwidth_world_and_oversubscription() -> None:
    labels = ["allreduce", "fp16", "topk", "powersgd"]
    fast = simulate(labels, [64], COMPUTE, Cluster(inter="100gbe"))
    slow = simulate(labels, [64], COMPUTE, Cluster(inter="1gbe"))
    over = simulate(labels, [64], COMPUTE, Cluster(inter="100gbe", oversubscription=4.0))
    for f, s, o in zip(fast, slow, over):
        assert f.step_s < s.step_s and f.step_s <= o.step_s  # type: ignore[operator]
        assert f.bytes == s.bytes == o.bytes  # bytes follow the schedule, not the link
    grow = simulate(["allreduce"], [8, 64, 512, 4096], COMPUTE, Cluster(inter="25gbe"))
    steps = [r.step_s for r in grow]
    assert steps == sorted(steps)


def test_limits_one_device_and_slow_link_speedups() -> None:
    row = simulate(["allreduce", "topk"], [1], COMPUTE, Cluster())
    for r in row:
        assert r.bytes == 0 and r.step_s == pytest.approx(COMPUTE.step_s)
    assert row[0].speedup == 1.0
    # on 1 GbE between hosts, a 100x smaller payload wins over the dense allreduce
    rows = simulate(["allreduce", "powersgd"], [64], COMPUTE, Cluster(inter="1gbe"))
    assert _row(rows, "powersgd", 64).speedup > 2.0


def test_skips_auto_and_one_host_hierarchical_and_does_not_fit() -> None:
    rows = simulate(["auto", "allreduce:hierarchical=true"], [8, 64], COMPUTE, Cluster())
    assert _row(rows, "auto", 64).step_s is None and "delegates" in _row(rows, "auto", 64).note
    assert _row(rows, "allreduce:hierarchical=true", 8).step_s is None
    assert _row(rows, "allreduce:hierarchical=true", 64).speedup > 1.0
    tiny = Device("tiny", 1e14, 1e12, 16 * N + 4e6, "nvlink4")  # 4 MB left after the model
    rows = simulate(["topk", "allreduce"], [8, 4096], COMPUTE, Cluster(), tiny)
    assert _row(rows, "topk", 8).step_s is not None
    assert "does not fit" in _row(rows, "topk", 4096).note
    assert _row(rows, "allreduce", 4096).step_s is not None


def test_device_compute_and_meta_capture() -> None:
    with torch.device("meta"):
        big = nn.Sequential(nn.Linear(50_000, 50_000), nn.Linear(50_000, 10))  # 2.5e9, no alloc
    specs = module_tensors(big)
    assert specs[0].name == "1.bias" and sum(s.numel for s in specs) == 2_500_550_010
    h100 = device("H100")
    c = device_compute(specs, h100, samples=4, efficiency=0.5)
    n = 2_500_550_010
    assert c.forward_s == pytest.approx(2 * n * 4 / (989e12 * 0.5))
    assert c.backward_s == pytest.approx(2 * c.forward_s)
    assert c.ready_s == sorted(c.ready_s) and c.ready_s[-1] == pytest.approx(c.backward_s)
    gpt, tokens = reference_tensors("gpt", layers=2, width=128, block=32)
    assert tokens == 32 and len(gpt) > 10
    assert len(params_tensors(1000, 10)) == 10


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ConfigError, match="devices_per_host"):
        Cluster(devices_per_host=0)
    with pytest.raises(ConfigError, match="multiple of devices_per_host"):
        Cluster(devices_per_host=8).network(12)
    with pytest.raises(ConfigError, match="world size"):
        Cluster().network(0)
    with pytest.raises(ConfigError, match="positive number of Gbit/s"):
        Cluster(inter="0gbit")
    with pytest.raises(ConfigError, match="unknown link preset"):
        link("carrier-pigeon")
    assert link("100mbit").rate_bps == 12.5e6 and link("40gbit").rate_bps == 5e9
    with pytest.raises(ConfigError, match="positive number of Mbit/s"):
        link("-5mbit")
    with pytest.raises(ConfigError, match="unknown device profile"):
        device("tpu")
    with pytest.raises(ConfigError, match="is not registered"):
        simulate(["nope"], [8], COMPUTE, Cluster())
    with pytest.raises(ConfigError, match="oversubscription"):
        Cluster(oversubscription=0.5)
    assert {"a100", "h100"} <= set(DEVICES) and {"25gbe", "ib-ndr", "1gbe"} <= set(LINKS)


def test_cli_json_and_plot(tmp_path, capsys) -> None:
    png = tmp_path / "steps.png"
    rc = main(["simulate", "--model", "uniform", "--params", "1000000", "--layers", "4",
               "--world", "8,16",
               "--algorithms", "allreduce,topk", "--json", "--plot", str(png)])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["label"], r["world"]) for r in rows] == [
        ("allreduce", 8), ("topk", 8), ("allreduce", 16), ("topk", 16)]
    assert rows[0]["speedup"] == 1.0 and rows[3]["bytes"] > rows[1]["bytes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc = main(["simulate", "--model", "uniform", "--params", "1000000", "--world", "8",
               "--algorithms", "allreduce"])
    assert rc == 0 and "| allreduce | 8 |" in capsys.readouterr().out
    rc = main(["simulate", "--model", "mlp", "--params", "5000", "--layers", "1",
               "--device", "local", "--batch", "4", "--world", "1,4", "--algorithms", "topk",
               "--json"])
    local = json.loads(capsys.readouterr().out)  # compute and top-k cost measured here
    assert rc == 0 and local[0]["compute_s"] > 0 and local[0]["compress_s"] == 0.0
    assert local[1]["compress_s"] > 0 and local[1]["bytes"] > 0
    assert main(["simulate", "--world", "12", "--model", "uniform", "--params", "1000"]) == 2
    assert "multiple of devices_per_host" in capsys.readouterr().err


def test_device_compressor_cost_follows_the_format() -> None:
    from hexagram.cost.model import gathered_decodes
    from hexagram.cost.simulate import device_compressor_cost

    a100 = device("a100")  # no measurement of it: the memory-bound assumption
    dense = device_compressor_cost(a100, make("fp16"))
    # the same density for both (the registry defaults differ: top-k 0.02, gTop-k 0.01)
    topk = device_compressor_cost(a100, make("topk:density=0.01"))
    gtopk = device_compressor_cost(a100, make("gtopk:density=0.01"))
    assert dense.encode(10**6) == topk.encode(10**6)  # same memory-bound encoding
    # top-k's gathered payload: density 0.01, 8 bytes a pair -> 2% of the dense bytes
    assert topk.decompress[1] == pytest.approx(dense.decompress[1] * 0.02, rel=1e-3)
    assert gtopk.decompress == topk.decompress  # one payload costs the same to decode
    # how many: the model decodes P payloads of top-k, log2 P merges + 1 for gTop-k
    assert gathered_decodes(make("gtopk"), 4096) == 13
    assert gathered_decodes(make("gtopk"), 6) == 4 and gathered_decodes(make("gtopk"), 2) == 2
    assert gathered_decodes(make("topk"), 4096) == 4096


def test_gtopk_decodes_counted_once_per_round_in_the_model() -> None:
    net = Cluster(devices_per_host=8, inter="25gbe").network(4096)
    dec_only = CompressorCost((0.0, 0.0), (0.0, 1e-9))
    got = {lb: predict_any(make(lb), COMPUTE, net, {lb: dec_only}, label=lb).compress_s
           for lb in ("topk:density=0.01", "gtopk:density=0.01")}
    # same segments, same per-payload decode: 13 decodes against 4096
    assert got["gtopk:density=0.01"] == pytest.approx(got["topk:density=0.01"] * 13 / 4096)


def test_help_example_runs(capsys) -> None:
    from hexagram.bench.simulate_cli import EXAMPLE, EXAMPLE_ARGS

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = capsys.readouterr().out
    assert "hexagram simulate --model mlp" in text and EXAMPLE.splitlines()[1] in text
    assert main(["simulate", *EXAMPLE_ARGS.split()]) == 0
    out = capsys.readouterr().out
    assert "| gtopk | 4096 |" in out and "| powersgd | 512 |" in out


def test_large_p_latency_follows_the_backend() -> None:
    # 4096 ranks, 512 hosts: NCCL's tree keeps allreduce latency at log2(H) hops, gloo's ring
    # pays 2 (P-1); the bytes on the wire are the same schedule either way
    nccl = simulate(["allreduce", "powersgd"], [64, 4096], COMPUTE, Cluster(inter="25gbe"))
    gloo = simulate(["allreduce", "powersgd"], [64, 4096], COMPUTE,
                    Cluster(inter="25gbe", backend="gloo"))
    for a, b in zip(nccl, gloo):
        assert a.bytes == b.bytes and a.step_s <= b.step_s  # type: ignore[operator]
    big_nccl, big_gloo = _row(nccl, "powersgd", 4096), _row(gloo, "powersgd", 4096)
    assert big_gloo.step_s > 5 * big_nccl.step_s  # type: ignore[operator]
    # with trees, PowerSGD's small allreduces barely grow from 64 to 4096 ranks
    assert _row(nccl, "powersgd", 4096).step_s < 3 * _row(nccl, "powersgd", 64).step_s  # type: ignore[operator]
    mpi = simulate(["allreduce"], [4096], COMPUTE, Cluster(inter="25gbe", backend="mpi"))
    assert mpi[0].bytes == nccl[2].bytes and mpi[0].step_s is not None


def test_cli_imports_only_what_it_runs() -> None:
    """``--help`` imports no torch; a GPT run imports no ``torch._dynamo`` (the engine's
    decorators and the meta device's ``normal_`` each did: ~1.7 of its 3-4 CPU-s)."""
    code = ("import sys\nfrom hexagram.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'torch._dynamo') if m in sys.modules))")
    run = [sys.executable, "-c", code, "simulate"]
    out = subprocess.run([*run, "--help"], capture_output=True, text=True, check=True).stdout
    assert "--algorithms" in out and out.splitlines()[-1] == "[]"
    out = subprocess.run([*run, "--model", "gpt", "--layers", "2", "--width", "64",
                          "--world", "8,64", "--algorithms", "allreduce,topk"],
                         capture_output=True, text=True, check=True).stdout
    assert "| topk | 64 |" in out and out.splitlines()[-1] == "['torch']"


def test_gpu_compressors_are_priced_from_measurements() -> None:
    from hexagram.cost.gpu_measured import CLONE_S_PER_ELEMENT, H200_RATIOS
    from hexagram.cost.simulate import device_compressor_cost

    h200 = device("h200")
    qsgd = device_compressor_cost(h200, make("qsgd"))
    assert qsgd.compress[1] == pytest.approx(CLONE_S_PER_ELEMENT / H200_RATIOS["qsgd"][0])
    # sparse decodes add pairs: priced by the payload (top-k 0.01: 2% of the dense bytes)
    topk = device_compressor_cost(h200, make("topk:density=0.01"))
    assert topk.decompress[1] == pytest.approx(
        CLONE_S_PER_ELEMENT / H200_RATIOS["topk"][1] * 0.02, rel=1e-3)
    # a sign payload decodes into the whole tensor: dense, as measured
    sign = device_compressor_cost(h200, make("signsgd"))
    assert sign.decompress[1] == pytest.approx(CLONE_S_PER_ELEMENT / H200_RATIOS["sign"][1])
    # far slower than the memory-bound assumption on the same device
    assert qsgd.encode(10**8) > 5 * device_compressor_cost(device("a100"), make("qsgd")
                                                            ).encode(10**8) * 2.039 / 4.8


def test_powersgd_on_one_nvlink_host_is_slower_than_allreduce_as_measured(capsys) -> None:
    # one host of 8 H100s: the measured compressors cost more than NVLink saves
    rc = main(["simulate", "--model", "uniform", "--params", "100000000", "--layers", "4",
               "--world", "8",
               "--algorithms", "allreduce,powersgd", "--json"])
    rows = {r["label"]: r for r in json.loads(capsys.readouterr().out)}
    assert rc == 0 and rows["powersgd"]["speedup"] < 1.0
    assert main(["simulate", "--model", "uniform", "--params", "1000000", "--world", "8",
                 "--algorithms",
                 "allreduce,fp16"]) == 0
    assert "measured on one NVIDIA H200" in capsys.readouterr().out
