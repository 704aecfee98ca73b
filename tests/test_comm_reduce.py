"""hexagram.comm.reduce: the one reduce-with-a-compressor path, against plain arithmetic.

Single-process: the routing rule. On 3 ranks (uneven chunks): every route's result against
the mean/sum/vote of what each rank's payload decodes to, the same bits on every rank,
results decoded into the caller's buffers, the caller's encoder (error feedback) honoured,
and the bytes each route counts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hexagram.compress as hc
from hexagram.comm.reduce import Route, route
from hexagram.launch import run_local

WORLD = 3
SIZES = (1000, 7)


def test_route_follows_the_aggregation_with_one_rule() -> None:
    assert route(None) is Route.ALLREDUCE
    assert route(hc.get("fp16")) is Route.SUM
    assert route(hc.get("fp16"), exact_local=True) is Route.SUM  # nothing re-compressed
    assert route(hc.get("qsgd")) is Route.SCATTER_GATHER
    assert route(hc.get("qsgd"), exact_local=True) is Route.GATHER  # error feedback
    assert route(hc.get("minmax8"), reduction="majority") is Route.GATHER
    assert route(hc.get("topk", density=0.1)) is Route.GATHER
    assert route(hc.get("powersgd")) is Route.GATHER  # factors do not sum one by one


def _inputs(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(n, generator=gen) for n in SIZES]


def _decoded(name: str, rank: int, divisor: int = 1) -> list[torch.Tensor]:
    c = hc.get(name)
    return [c.decompress(c.compress(t / divisor if divisor > 1 else t)) for t in _inputs(rank)]


def _worker() -> dict[str, Any]:
    import hexagram as hx
    from hexagram.comm.communicator import Communicator
    from hexagram.comm.reduce import reduce, reduce_many

    rt = hx.init(timeout=60)
    comm = Communicator(None, rt.timeout, "reduce")
    out: dict[str, Any] = {}

    def run(key: str, compressor: str | None, **kw: Any) -> None:
        comp = None if compressor is None else hc.get(compressor)
        before = comm.counter.total
        out[key] = reduce_many(comm, _inputs(rt.rank), comp, **kw).wait()
        out[key + ".bytes"] = comm.counter.total - before

    run("exact", None)
    run("exact_sum", None, reduction="sum")
    run("fp16", "fp16")
    run("minmax8", "minmax8")
    run("topk", "topk")
    run("sign_vote", "sign", reduction="majority")
    run("terngrad_sum", "terngrad", reduction="sum")
    # the caller's buffers: results land in them, inputs encoded first
    mine = _inputs(rt.rank)
    got = reduce_many(comm, mine, hc.get("topk"), outs=mine).wait()
    out["in_place"] = all(g.data_ptr() == m.data_ptr() for g, m in zip(got, mine))
    out["in_place_values"] = got
    # an encoder (error feedback): no scatter-gather; SUM divides before encoding
    calls: list[tuple[int, int]] = []

    def encoder(name: str) -> Any:
        c = hc.get(name)

        def encode(i: int, t: torch.Tensor, divisor: int) -> hc.Payload:
            calls.append((i, divisor))
            return c.compress(t / divisor if divisor > 1 else t)
        return encode

    before = comm.counter.total
    out["encoded_minmax8"] = reduce_many(comm, _inputs(rt.rank), hc.get("minmax8"),
                                         encode=encoder("minmax8")).wait()
    out["encoded_minmax8.bytes"] = comm.counter.total - before
    out["encoded_fp16"] = reduce(comm, _inputs(rt.rank)[0], hc.get("fp16"),
                                 encode=encoder("fp16")).wait()
    out["calls"] = calls
    out["by_op"] = comm.counter.by_op()
    comm.close()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local(_worker, WORLD, timeout=120)


def _mean(tensors: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [sum(ts) / len(ts) for ts in zip(*tensors)]  # type: ignore[misc]


def _close(got: list[torch.Tensor], want: list[torch.Tensor], atol: float) -> bool:
    return len(got) == len(want) and all(torch.allclose(g, w, atol=atol)
                                         for g, w in zip(got, want))


def test_every_route_gives_the_same_bits_on_every_rank(results: list[dict[str, Any]]) -> None:
    keys = [k for k, v in results[0].items() if isinstance(v, list) and k != "calls"]
    assert len(keys) >= 9
    for r in results[1:]:
        for k in keys:
            assert all(torch.equal(a, b) for a, b in zip(results[0][k], r[k])), k


def test_results_against_arithmetic(results: list[dict[str, Any]]) -> None:
    res = results[0]
    inputs = [_inputs(r) for r in range(WORLD)]
    assert _close(res["exact"], _mean(inputs), 1e-6)
    assert _close(res["exact_sum"], [sum(ts) for ts in zip(*inputs)], 1e-5)  # type: ignore
    scaled = [_decoded("fp16", r, WORLD) for r in range(WORLD)]  # divided before encoding
    assert _close(res["fp16"], [sum(x) for x in zip(*scaled)], 1e-3)  # type: ignore[misc]
    assert _close(res["minmax8"], _mean(inputs), 0.05)  # two 8-bit legs
    topk = _mean([_decoded("topk", r) for r in range(WORLD)])
    assert _close(res["topk"], topk, 1e-6) and _close(res["in_place_values"], topk, 1e-6)
    votes = [sum(ts).sign() for ts in zip(*[[t.sign() for t in _inputs(r)]  # type: ignore
                                            for r in range(WORLD)])]
    assert all(torch.equal(g, w) for g, w in zip(res["sign_vote"], votes))
    # terngrad is stochastic: each rank's element is off by at most its max |x|, and the
    # values are ternary multiples of the ranks' scales (not the exact sum)
    for got, ts in zip(res["terngrad_sum"], zip(*inputs)):
        assert float((got - sum(ts)).abs().max()) <= sum(float(t.abs().max()) for t in ts)
        assert not torch.allclose(got, sum(ts), atol=1e-3)
    assert res["in_place"]


def test_encoder_is_honoured_and_rules_out_scatter_gather(
        results: list[dict[str, Any]]) -> None:
    res = results[0]
    assert res["calls"] == [(0, 1), (1, 1), (0, WORLD)]  # SUM divides before encoding
    assert _close(res["encoded_minmax8"], _mean([_decoded("minmax8", r) for r in range(WORLD)]),
                  1e-6)
    fp16 = sum(_decoded("fp16", r, WORLD)[0] for r in range(WORLD))
    assert torch.allclose(res["encoded_fp16"], fp16, atol=1e-3)


def _payload_bytes(name: str, n: int) -> int:
    return hc.get(name).compress(torch.randn(n)).nbytes


def test_bytes_are_each_routes_formula(results: list[dict[str, Any]]) -> None:
    ring = sum(2 * (WORLD - 1) * 4 * n // WORLD for n in SIZES)
    gather = {n: (WORLD - 1) * sum(_payload_bytes(n, s) for s in SIZES)
              for n in ("topk", "minmax8")}
    fp16 = sum(2 * (WORLD - 1) * _payload_bytes("fp16", n) // WORLD for n in SIZES)
    chunks = sum(2 * (WORLD - 1) * _payload_bytes("minmax8", -(-n // WORLD)) for n in SIZES)
    for res in results:
        assert res["exact.bytes"] == res["exact_sum.bytes"] == ring
        assert res["fp16.bytes"] == fp16
        assert res["topk.bytes"] == gather["topk"]
        assert res["minmax8.bytes"] == chunks  # all-to-all + allgather of P chunks
        assert res["encoded_minmax8.bytes"] == gather["minmax8"]
        assert {"allreduce", "allreduce_compressed", "allgather_payloads",
                "scatter_gather.alltoall", "scatter_gather.allgather"} <= set(res["by_op"])


def test_bad_reduction_is_named() -> None:
    from hexagram.comm.reduce import reduce_many

    with pytest.raises(ValueError, match="reduction must be one of"):
        reduce_many(None, [torch.ones(2)], None, reduction="max")  # type: ignore[arg-type]
