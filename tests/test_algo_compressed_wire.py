"""Compressed algorithms on 3 ranks with designed gradients: bytes, agreement, exact cases.

A probe model whose loss is ``sum_i <w_i, x_i>`` has gradient ``x_i`` exactly, so each rank
feeds a chosen gradient. For every algorithm, one spawned job checks:

- wire bytes per step (``model.bytes_sent()``) equal the compressor's payload size times the
  formula of the collective the algorithm uses (computed here, independently);
- every rank applies the same reduced gradient (bit for bit);
- exact semantics where they are known (top-k mean, majority vote, exactly k entries for
  gtopk, PowerSGD exact on a rank-1 mean, fp16/8-bit close to the mean);
- resuming from ``algorithm_state_dict()`` continues exactly as an uninterrupted run.

World size 3 makes chunks uneven (no power of two, sizes not divisible by 3). Every
registered compressed-gradient algorithm is checked (by class, from the registry): CASES
only gives configs; an algorithm without a case runs with its defaults, and its bytes follow
from its compressor, granularity and route (hexagram.comm.reduce.route).
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from torch import nn

import hexagram.compress as hc
from hexagram.algorithms import registry
from hexagram.algorithms.compressed import CompressedAlgorithm, CompressorAlgorithm
from hexagram.algorithms.gtopk import sparse_pairs
from hexagram.comm.gtopk import butterfly, tree_children
from hexagram.comm.reduce import Route, route
from hexagram.compress.segments import Segments
from hexagram.launch import run_local

WORLD = 3
SHAPES = {"a": (40, 30), "b": (30,), "c": (17, 5)}
NUMELS = {n: torch.Size(s).numel() for n, s in SHAPES.items()}
TOTAL = sum(NUMELS.values())

# algorithm -> (config, compressor name, compressor config)
CASES: dict[str, tuple[dict[str, Any], str, dict[str, Any]]] = {
    "fp16": ({}, "fp16", {}),
    "bytegrad": ({"chunk_size": 64}, "minmax8", {"chunk_size": 64}),
    "qsgd": ({"levels": 7, "bucket_size": 128}, "qsgd", {"levels": 7, "bucket_size": 128}),
    "terngrad": ({}, "terngrad", {}),
    "onebit": ({}, "onebit", {}),
    "efsign": ({}, "efsign", {}),
    "signsgd": ({}, "sign", {}),
    "topk": ({"density": 0.05}, "topk", {"density": 0.05}),
    "gtopk": ({"density": 0.05}, "topk", {"density": 0.05}),
    "dgc": ({"density": 0.05}, "topk", {"density": 0.05}),
    "randomk": ({"density": 0.05}, "randomk", {"density": 0.05}),
    "powersgd": ({"rank": 1, "start_iter": 0}, "", {}),  # rank 1: exact on a rank-1 mean
}
NAMES = [n for n, e in registry.entries().items() if issubclass(e.load()[1], CompressedAlgorithm)]


#: configs of algorithms outside CASES that need one with the probe's plain SGD
OWN = {"decoupled_momentum": {"momentum": 0.9}}  # no SGD momentum to take over: its own


def _config(name: str) -> dict[str, Any]:
    return CASES[name][0] if name in CASES else OWN.get(name, {})


class Probe(nn.Module):
    """loss = sum_i <w_i, x_i>: the gradient of w_i is x_i."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.ParameterDict({n: nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()})

    def forward(self, xs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((self.w[n] * xs[n]).sum() for n in SHAPES)  # type: ignore[return-value]


def inputs(step: int, rank: int, rank1: bool = False) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s gradient at ``step``; with ``rank1`` every matrix is u_rank v^T."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    xs = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    if rank1:
        shared = torch.Generator().manual_seed(7 + step)
        for n, s in SHAPES.items():
            if len(s) == 2:
                v = torch.randn(s[1], generator=shared)
                xs[n] = torch.outer(torch.randn(s[0], generator=g), v)
    return xs


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().numpy().tobytes())
    return h.hexdigest()


def _run(name: str, config: dict[str, Any], steps: int, rank1: bool = False,
         state: dict[str, Any] | None = None, first: int = 0) -> dict[str, Any]:
    """Train the probe; return per-step grads (rank 0 compares), bytes, digests and state."""
    import hexagram as hx

    rt = hx.get_runtime()
    torch.manual_seed(0)
    net = Probe()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(name, **config))
    if state is not None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        model.load_algorithm_state_dict(state["algo"])
    out: dict[str, Any] = {"bytes": [], "grads": [], "digests": []}
    for step in range(first, first + steps):
        before = model.bytes_sent()
        model(inputs(step, rt.rank, rank1)).backward()
        out["bytes"].append(model.bytes_sent() - before)
        grads = [net.w[n].grad.clone() for n in SHAPES]  # type: ignore[union-attr]
        out["grads"].append([g.reshape(-1).tolist() for g in grads])
        out["digests"].append(_digest(grads))
        opt.step()
        opt.zero_grad()
    out["final"] = _digest(list(net.parameters()))
    out["state"] = {"model": net.state_dict(), "opt": opt.state_dict(),
                    "algo": model.algorithm_state_dict()}
    model.close()
    return out


def _bad_steps(name: str, config: dict[str, Any], poison: dict[int, tuple[int, ...]],
               value: float) -> dict[str, Any]:
    """Steps 0-2 where rank r's gradient of ``b`` gets ``value`` at steps poison[r]."""
    import hexagram as hx

    rt = hx.get_runtime()
    torch.manual_seed(0)
    net = Probe()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(name, **config))
    out: dict[str, Any] = {"errors": [], "zero_steps": []}
    for step in range(3):
        xs = inputs(step, rt.rank)
        if step in poison.get(rt.rank, ()):
            xs["b"][3] = value
        try:  # the range check raises in backward; the NaN/Inf check at the optimizer step
            model(xs).backward()
            opt.step()
        except hx.NonFiniteGradientError as exc:
            out["errors"].append(str(exc))
            break
        if all(float(p.grad.abs().max()) == 0.0 for p in net.parameters()):  # type: ignore
            out["zero_steps"].append(step)
        opt.zero_grad()
    out["skipped"] = getattr(model.algorithm, "skipped_steps", None)
    model.close()
    return out


def _bad_input_cases() -> dict[str, Any]:
    everyone = {r: (1,) for r in range(WORLD)}
    return {
        "raise": _bad_steps("powersgd", {"start_iter": 0}, everyone, float("nan")),
        "skip": _bad_steps("fp16", {"on_nonfinite": "skip"}, {1: (1,)}, float("inf")),
        "overflow": _bad_steps("fp16", {}, everyone, 1e5 * WORLD),
    }


def _worker(names: list[str]) -> dict[str, Any]:
    import hexagram as hx

    hx.init()
    results: dict[str, Any] = {"bad_input": _bad_input_cases()}
    for name in names:
        config = _config(name)
        rank1 = name == "powersgd"
        full = _run(name, config, steps=4, rank1=rank1)
        head = _run(name, config, steps=2, rank1=rank1)
        tail = _run(name, config, steps=2, rank1=rank1, state=head["state"], first=2)
        results[name] = {"bytes": full["bytes"], "grads": full["grads"][:1],
                         "digests": full["digests"], "resumed": tail["final"] == full["final"]}
    return results


def _k(ccfg: dict[str, Any], numel: int) -> int:
    """Pairs a sparsifier of this config keeps of ``numel`` elements (its payload size)."""
    return sparse_pairs(hc.get("topk", **ccfg).compress(torch.randn(numel)))[0].numel()


def expected_bytes(name: str, rank: int, world: int) -> int:
    """Bytes rank ``rank`` sends per step: payload sizes times each collective's formula,
    plus the engine's agreement on non-finite gradients (a ring allreduce of one int64),
    which an algorithm whose sum carries NaN/Inf to every rank (fp16) does without."""
    agreement = 0 if registry.get(name, **_config(name)).passes_nonfinite else \
        2 * (world - 1) * 8 // world
    return _payload_bytes(name, rank, world) + agreement


def _payload_bytes(name: str, rank: int, world: int) -> int:
    """The algorithm's own bytes per step (see :func:`expected_bytes`)."""
    config = _config(name)
    if name == "powersgd":  # ring allreduce of all P (n x r) + vectors, then of all Q (m x r)
        r = config["rank"]
        first = 40 * r + 30 + 17 * r  # P of a (40x30) and c (17x5); the vector b goes dense
        second = 30 * r + 5 * r
        return sum(2 * (world - 1) * (4 * n) // world for n in (first, second))
    algo = registry.get(name, **config)
    sizes = [TOTAL] if algo.config.granularity == "bucket" else list(NUMELS.values())
    if name == "gtopk":  # one message of k (float32, int32) pairs up, one per tree child down
        ks = [_k(CASES[name][2], n) for n in sizes]  # (or one per round of recursive doubling)
        edges = world.bit_length() - 1 if butterfly(world) else \
            (rank != 0) + len(tree_children(rank, world))
        # and the step's 8-byte fault allreduce (min), one per step after the last bucket
        return sum(8 * k * edges for k in ks) + 2 * (world - 1) * 8 // world
    if name == "randomk":  # shared positions: one ring allreduce of the k float32 values
        return 2 * (world - 1) * 4 * sum(_k(CASES[name][2], n) for n in sizes) // world
    assert isinstance(algo, CompressorAlgorithm), f"{name}: add its byte formula here"
    comp = algo.compressor
    way = route(comp, exact_local=algo.error_feedback is not None or algo.custom_encoding,
                reduction=algo.reduction)
    total = 0
    for n in sizes:
        if way is Route.SUM:  # ring allreduce of the payload
            total += 2 * (world - 1) * comp.compress(torch.randn(n)).nbytes // world
        elif way is Route.SCATTER_GATHER:
            # P chunks of ceil(n/P): all-to-all sends P-1 of them, allgather P-1 copies of one
            total += 2 * (world - 1) * comp.compress(torch.randn(-(-n // world))).nbytes
        elif len(sizes) == 1:  # ring allgather of the payload
            total += (world - 1) * comp.compress(torch.randn(n)).nbytes
    if way is Route.GATHER and len(sizes) > 1:  # one bucket payload, packed across tensors
        payload = comp.compress_segments(torch.randn(TOTAL), Segments.of(sizes))
        total += (world - 1) * payload.nbytes
    return total


@pytest.fixture(scope="module")
def wire_results() -> list[dict[str, Any]]:
    return run_local(_worker, WORLD, args=(NAMES,), timeout=240)


@pytest.mark.parametrize("name", NAMES)
def test_bytes_agreement_and_resume(name: str, wire_results: list[dict[str, Any]]) -> None:
    per_rank = [r[name] for r in wire_results]
    for rank, res in enumerate(per_rank):
        assert res["bytes"] == [expected_bytes(name, rank, WORLD)] * 4, f"rank {rank}"
        assert res["digests"] == per_rank[0]["digests"], "ranks applied different gradients"
        assert res["resumed"], "resuming from the algorithm's state_dict diverged"


def _mean_of_decompressed(comp: str, ccfg: dict[str, Any], segs: list[list[torch.Tensor]]
                          ) -> torch.Tensor:
    c = hc.get(comp, **ccfg)
    return torch.cat([torch.stack([c.decompress(c.compress(x)).reshape(-1) for x in per_rank])
                      .mean(0) for per_rank in segs])


def _step0(name: str, wire_results: list[dict[str, Any]]) -> tuple[torch.Tensor, list[Any]]:
    got = torch.tensor([v for g in wire_results[0][name]["grads"][0] for v in g])
    xs = [inputs(0, r, rank1=name == "powersgd") for r in range(WORLD)]
    return got, xs


def test_fp16_is_the_mean(wire_results: list[dict[str, Any]]) -> None:
    got, xs = _step0("fp16", wire_results)
    mean = torch.cat([torch.stack([x[n] for x in xs]).mean(0).reshape(-1) for n in SHAPES])
    assert torch.allclose(got, mean, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("name", ["topk", "dgc"])
def test_sparse_mean_of_local_topk(name: str, wire_results: list[dict[str, Any]]) -> None:
    got, xs = _step0(name, wire_results)  # step 0: no residual, no momentum yet
    expect = _mean_of_decompressed("topk", CASES[name][2],
                                   [[x[n].reshape(-1) for x in xs] for n in SHAPES])
    assert torch.allclose(got, expect, atol=1e-6)


def test_signsgd_majority_vote(wire_results: list[dict[str, Any]]) -> None:
    got, xs = _step0("signsgd", wire_results)
    flat = [torch.cat([x[n].reshape(-1) for n in SHAPES]) for x in xs]
    votes = sum(f.sign() for f in flat)
    assert isinstance(votes, torch.Tensor)
    # scaled by default: the ranks' mean of each rank's rms(g) over the segment (the bucket)
    scale = torch.stack([f.pow(2).mean().sqrt() for f in flat]).mean()
    assert torch.allclose(got, votes.sign() * scale, rtol=1e-6, atol=0)
    assert set(got.abs().unique().tolist()) == {float(got.abs().max())}  # one magnitude


def test_gtopk_applies_exactly_k_per_layer(wire_results: list[dict[str, Any]]) -> None:
    got, _ = _step0("gtopk", wire_results)
    offset = 0
    for n, numel in NUMELS.items():
        k = _k(CASES["gtopk"][2], numel)
        assert int((got[offset:offset + numel] != 0).sum()) == k, n
        offset += numel


def test_powersgd_exact_on_rank_one_mean(wire_results: list[dict[str, Any]]) -> None:
    got, xs = _step0("powersgd", wire_results)
    mean = torch.cat([torch.stack([x[n] for x in xs]).mean(0).reshape(-1) for n in SHAPES])
    assert torch.allclose(got, mean, atol=1e-4)


def test_bytegrad_close_to_mean(wire_results: list[dict[str, Any]]) -> None:
    got, xs = _step0("bytegrad", wire_results)
    mean = torch.cat([torch.stack([x[n] for x in xs]).mean(0).reshape(-1) for n in SHAPES])
    # two 8-bit legs, 64-element chunks of N(0, 1) data: about 1% relative error
    assert float((got - mean).norm() / mean.norm()) < 0.03


def test_nan_is_reported_with_step_and_parameter(wire_results: list[dict[str, Any]]) -> None:
    for res in wire_results:
        (message,) = res["bad_input"]["raise"]["errors"]
        assert "'w.b'" in message and "step 1" in message and "NaN or Inf" in message


def test_skip_policy_skips_the_step_on_every_rank(wire_results: list[dict[str, Any]]) -> None:
    for res in wire_results:  # only rank 1 saw Inf; every rank skipped step 1, not 0 or 2
        skip = res["bad_input"]["skip"]
        assert skip["errors"] == [] and skip["zero_steps"] == [1] and skip["skipped"] == 1


def test_fp16_overflow_is_an_error_not_inf(wire_results: list[dict[str, Any]]) -> None:
    for res in wire_results:
        (message,) = res["bad_input"]["overflow"]["errors"]
        assert "w.b" in message and "bf16" in message
