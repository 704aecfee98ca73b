"""``cast="fp16"`` / ``"bf16"`` around any gradient algorithm (:mod:`hexagram.algorithms.cast`).

One 2-rank job: cast allreduce sends the ``fp16`` algorithm's bytes and agrees with it to
fp16's rounding (it divides after the sum, ``fp16`` before); every castable gradient
algorithm trains with both casts, its replicas identical across ranks; the float payloads
shrink by half (PowerSGD's factors exactly, top-k's values next to unchanged indices); an
fp16 overflow is refused with a clear error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hexagram.launch import run_local


def _train(name: str, steps: int = 3, seed: int = 0, **config: Any) -> dict[str, Any]:
    from _every_algorithm import config_for, optimizer_for, small_model

    import hexagram as hx

    rt = hx.get_runtime()
    model = small_model(seed)
    opt = optimizer_for(name, model.parameters())
    algo = hx.algorithms.get(name, **{**config_for(name), **config})
    ddp = hx.DistributedDataParallel(model, optimizers=[opt], algorithm=algo, bucket_size_mb=0.001)
    gen = torch.Generator().manual_seed(100 + rt.rank)
    grads = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        nn.functional.cross_entropy(ddp(x), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        opt.step()
        opt.zero_grad()
    ddp.synchronize()
    out = {"grads": grads, "bytes": ddp.bytes_sent(),
           "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
    ddp.close()
    return out


def _overflow() -> str:
    import hexagram as hx

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = hx.DistributedDataParallel(model, optimizers=[opt],
                                     algorithm=hx.algorithms.get("topk", cast="fp16"))
    try:
        (ddp(torch.full((1, 4), 1e5)).sum() * 1e3).backward()
        opt.step()  # the step's checks are read at the optimizer step
    except hx.NonFiniteGradientError as e:
        return str(e)
    finally:
        ddp.close()
    return "no error"


def _worker() -> dict[str, Any]:
    import hexagram as hx
    from hexagram.algorithms.cast import INCOMPATIBLE

    hx.init()
    out: dict[str, Any] = {
        "fp16": _train("fp16"), "allreduce+fp16": _train("allreduce", cast="fp16"),
        "powersgd": _train("powersgd", start_iter=0),
        "powersgd+bf16": _train("powersgd", start_iter=0, cast="bf16"),
        "topk": _train("topk"), "topk+fp16": _train("topk", cast="fp16"),
        "overflow": _overflow()}
    grad_algos = [n for n in hx.algorithms.names()
                  if hx.algorithms.registry.get(n).kind == "grad" and n not in INCOMPATIBLE]
    for name in grad_algos:
        for cast in ("fp16", "bf16"):
            out.setdefault(f"{name}+{cast}", _train(name, cast=cast))
    out["names"] = grad_algos
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_local(_worker, 2, timeout=240)


def test_cast_allreduce_is_the_fp16_algorithm(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        a, b = r["fp16"], r["allreduce+fp16"]
        for x, y in zip(a["grads"], b["grads"]):
            torch.testing.assert_close(x, y, rtol=2e-3, atol=1e-5)
        assert a["bytes"] == b["bytes"] > 0


def test_every_castable_algorithm_trains_identically_on_every_rank(
        ranks: list[dict[str, Any]]) -> None:
    assert len(ranks[0]["names"]) >= 10  # selected by property: every gradient algorithm
    for name in ranks[0]["names"]:
        for cast in ("fp16", "bf16"):
            key = f"{name}+{cast}"
            p0, p1 = ranks[0][key]["params"], ranks[1][key]["params"]
            assert torch.isfinite(p0).all(), key
            if name != "robust":  # robust's replicas agree too, but f=0 trims nothing
                assert torch.equal(p0, p1), key
            assert ranks[0][key]["bytes"] > 0, key


def test_float_payloads_shrink_by_half(ranks: list[dict[str, Any]]) -> None:
    r = ranks[0]
    # PowerSGD's payload is all factors (and the biases, sent dense): exactly half, beside
    # the engine's one-int64 non-finite agreement per step (3 steps), which is not cast
    flag = 3 * 8
    assert (r["powersgd+bf16"]["bytes"] - flag) * 2 == r["powersgd"]["bytes"] - flag
    # top-k: 16-bit values next to unchanged indices
    assert r["topk+fp16"]["bytes"] < r["topk"]["bytes"]


def test_fp16_overflow_names_the_parameters(ranks: list[dict[str, Any]]) -> None:
    message = ranks[0]["overflow"]
    assert "passes fp16" in message and "weight" in message and "bf16" in message, message


def test_bad_casts_are_refused() -> None:
    import hexagram as hx
    from hexagram.errors import ConfigError

    with pytest.raises(ConfigError, match="cast must be one of"):
        hx.algorithms.get("topk", cast="fp8")
    with pytest.raises(ConfigError, match="16-bit already"):
        hx.algorithms.get("fp16", cast="bf16")
    with pytest.raises(ConfigError, match="communicates weights"):
        hx.algorithms.get("diloco", cast="fp16")
    algo = hx.algorithms.get("powersgd", cast="bf16", hierarchical=True, delay=1)
    assert [type(algo).__name__, type(algo.inner).__name__,
            type(algo.inner.inner).__name__] == ["Delayed", "Hierarchical", "Cast"]
