"""Wrappers compose with gradient algorithms: hierarchical x {fp16, powersgd, topk}, and
error feedback on a scatter-gather format (qsgd), on 4 ranks as 2 emulated hosts.

A probe model whose loss is ``sum_i <w_i, x_i>`` has gradient ``x_i``; each rank feeds a
chosen gradient. Checked: every rank applies the same gradient; hierarchical fp16 is the
mean of all ranks; hierarchical PowerSGD at rank 1 is exact on a rank-1 mean; hierarchical
top-k is the mean of the two host means' top-k; non-leaders send only their bucket to the
leader; qsgd with error feedback allgathers (exact local payloads) and applies the mean of
what each rank's error-feedback compression sent (replayed here step by step).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import hexagram.compress as hc
from hexagram.errors import ConfigError
from hexagram.launch import run_local

WORLD, SHAPE = 4, (24, 16)
#: the engine's per-step non-finite agreement of a compressor algorithm: one int64 summed
#: over every rank (bytes as the communicator counts an allreduce of 8 bytes)
FLAG = 2 * (WORLD - 1) * 8 // WORLD
CASES: dict[str, dict[str, Any]] = {
    "fp16": {"hierarchical": True},
    "powersgd": {"hierarchical": True, "rank": 1, "start_iter": 0},
    "topk": {"hierarchical": True, "density": 0.1},
    "qsgd": {"error_feedback": True, "levels": 3},
}


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(SHAPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def grad_of(rank: int, step: int) -> torch.Tensor:
    """Rank-1 per rank with a shared right factor, so every mean is rank 1."""
    g = torch.Generator().manual_seed(100 * step + rank)
    v = torch.randn(SHAPE[1], generator=torch.Generator().manual_seed(step))
    return torch.outer(torch.randn(SHAPE[0], generator=g), v)


def _worker() -> dict[str, Any]:
    import hexagram as hx

    os.environ["HEXAGRAM_HOST"] = str(int(os.environ["RANK"]) // 2)
    rt = hx.init(timeout=60)
    out: dict[str, Any] = {}
    for name, config in CASES.items():
        net = Probe()
        model = hx.DistributedDataParallel(net, algorithm=hx.algorithms.get(name, **config))
        grads, sent = [], []
        for step in range(2):
            before = model.bytes_sent()
            model(grad_of(rt.rank, step)).backward()
            sent.append(model.bytes_sent() - before)
            grads.append(net.w.grad.clone())  # type: ignore[union-attr]
            net.w.grad = None
        out[name] = {"grads": grads, "sent": sent, "type": type(model.algorithm).__name__}
        model.close()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local(_worker, WORLD, timeout=180)


def _mean(step: int, ranks: range | list[int] = range(WORLD)) -> torch.Tensor:
    return sum(grad_of(r, step) for r in ranks) / len(ranks)  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_applies_the_same_gradient(name: str, results: list[dict[str, Any]]) -> None:
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][name]["grads"],
                                                     r[name]["grads"]))


def test_hierarchical_fp16_and_powersgd_give_the_mean(results: list[dict[str, Any]]) -> None:
    res = results[0]
    assert res["fp16"]["type"] == res["powersgd"]["type"] == "Hierarchical"
    for step in range(2):
        assert torch.allclose(res["fp16"]["grads"][step], _mean(step), atol=2e-3)
        assert torch.allclose(res["powersgd"]["grads"][step], _mean(step), atol=1e-4)


def test_hierarchical_topk_is_topk_of_host_means(results: list[dict[str, Any]]) -> None:
    topk = hc.get("topk", density=0.1)
    hosts = [_mean(0, [0, 1]), _mean(0, [2, 3])]
    expect = sum(topk.decompress(topk.compress(h)) for h in hosts) / 2
    assert torch.allclose(results[0]["topk"]["grads"][0], expect, atol=1e-6)


def test_non_leaders_send_only_to_their_leader(results: list[dict[str, Any]]) -> None:
    n = 4 * SHAPE[0] * SHAPE[1]
    for name in ("fp16", "powersgd", "topk"):
        assert results[1][name]["sent"] == [n + FLAG] * 2 == results[3][name]["sent"], name
        assert results[0][name]["sent"][0] > n + FLAG  # its host + the inter-host leg


def test_qsgd_with_error_feedback_allgathers_and_keeps_the_error(
        results: list[dict[str, Any]]) -> None:
    qsgd = hc.get("qsgd", levels=3)
    payload = qsgd.compress(grad_of(0, 0)).nbytes
    assert results[0]["qsgd"]["sent"] == [(WORLD - 1) * payload + FLAG] * 2  # allgather
    # each rank: c = g + r; send Q(c) with its generator (seed 0, offset = rank); r = c - Q(c)
    gens = [torch.Generator().manual_seed(r) for r in range(WORLD)]
    residuals = [torch.zeros(SHAPE) for _ in range(WORLD)]
    for step in range(2):
        sent = []
        for r in range(WORLD):
            corrected = grad_of(r, step) + residuals[r]
            decoded = qsgd.decompress(qsgd.compress(corrected, gens[r]))
            residuals[r] = corrected - decoded
            sent.append(decoded)
        expect = sum(sent) / WORLD
        assert torch.allclose(results[0]["qsgd"]["grads"][step], expect, atol=1e-5), step
    assert step == 1 and float(sum(x.abs().sum() for x in residuals)) > 0


def test_hierarchical_refuses_weight_algorithms() -> None:
    import hexagram as hx

    with pytest.raises(ConfigError, match="hierarchical wraps gradient algorithms"):
        hx.algorithms.get("local_sgd", hierarchical=True)
    with pytest.raises(ConfigError, match="True or False"):
        hx.algorithms.get("topk", hierarchical="yes")
