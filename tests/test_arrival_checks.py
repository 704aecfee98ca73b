"""What arrives is checked: a peer's non-finite contribution never reaches an optimizer.

A Byzantine or faulty rank can send NaN past its own engine's check (the attack rewrites
the bucket after it). Every rank checks the reduced buckets once per step on the device
(the flag joins the step's one host read), and every rank decoded the same bytes, so:

- without ``robust``, every rank raises :class:`~hexagram.errors.NonFiniteGradientError`
  at the same step (allreduce, whose sum carries the NaN, included); with
  ``on_nonfinite="skip"`` every rank skips that step instead, parameters equal;
- with ``robust``, the NaN row is excluded before the aggregation and training goes on,
  for coordinate-wise and distance-based aggregators alike.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hexagram.launch import run_local

BAD_STEP, STEPS = 2, 4


def _run(name: str, config: dict[str, Any], attack: str, world: int) -> dict[str, Any]:
    import hexagram as hx
    from hexagram.testing.attacks import AttackConfig, AttackedAlgorithm

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    inner = hx.algorithms.get(name, **config)
    algo = AttackedAlgorithm(inner, AttackConfig(name=attack, ranks=(world - 1,)))
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)
    rank = hx.get_runtime().rank
    gen = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {"error": None, "stepped": []}
    for step in range(STEPS):
        x = torch.randn(8, 20, generator=gen)
        before = [p.detach().clone() for p in net.parameters()]
        try:
            model(x).square().mean().backward()
            opt.step()
        except hx.NonFiniteGradientError as exc:
            out["error"] = (step, type(exc).__name__, str(exc))
            break
        finally:
            opt.zero_grad()
        out["stepped"].append(any(not torch.equal(b, p)
                                  for b, p in zip(before, net.parameters())))
    out["params"] = [p.detach().clone() for p in net.parameters()]
    model.close()
    return out


CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    # attacks from step 0 on: the first step already carries the NaN
    "topk": ("topk", {"density": 0.1}, "nan"),
    "fp16": ("fp16", {}, "nan"),
    "allreduce": ("allreduce", {}, "nan"),
    "topk+skip": ("topk", {"density": 0.1, "on_nonfinite": "skip"}, "nan"),
}
ROBUST: dict[str, tuple[str, dict[str, Any], str]] = {
    "median": ("robust", {"aggregator": "median", "f": 1}, "nan"),
    "geomed": ("robust", {"aggregator": "geomed", "f": 1}, "nan"),
    "centered_clip": ("robust", {"aggregator": "centered_clip", "f": 1}, "nan"),
}


def _worker(cases: dict[str, tuple[str, dict[str, Any], str]]) -> dict[str, Any]:
    import hexagram as hx

    hx.init()
    world = hx.get_runtime().world_size
    return {key: _run(name, config, attack, world)
            for key, (name, config, attack) in cases.items()}


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_local(_worker, 2, args=(CASES,), timeout=240)


@pytest.fixture(scope="module")
def three() -> list[dict[str, Any]]:
    return run_local(_worker, 3, args=(ROBUST,), timeout=240)


@pytest.mark.parametrize("key", ["topk", "fp16", "allreduce"])
def test_every_rank_raises_at_the_same_step(key: str, two: list[dict[str, Any]]) -> None:
    errors = [r[key]["error"] for r in two]
    assert all(e is not None for e in errors), errors
    assert {e[0] for e in errors} == {0}, errors  # the step the NaN arrived, everywhere
    assert len({e[1:] for e in errors}) == 1, errors  # the same error, word for word
    honest = errors[0][2]
    if key == "topk":  # a gathered format: the decoders' check names the sender
        assert errors[0][1] == "MalformedPayloadError" and "rank 1 sent" in honest, honest
    else:  # a sum: the reduced result is non-finite, the sender cannot be known
        assert errors[0][1] in ("NonFiniteGradientError", "MalformedPayloadError"), errors
    assert "NaN" in honest, honest
    for r in two:  # nothing reached an optimizer
        assert all(torch.isfinite(p).all() for p in r[key]["params"])


def test_skip_skips_on_every_rank(two: list[dict[str, Any]]) -> None:
    for r in two:
        assert r["topk+skip"]["error"] is None
        assert r["topk+skip"]["stepped"] == [False] * STEPS  # zero gradient, plain SGD
    for pa, pb in zip(two[0]["topk+skip"]["params"], two[1]["topk+skip"]["params"]):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("key", list(ROBUST))
def test_robust_excludes_the_nan_row_and_trains_on(key: str,
                                                   three: list[dict[str, Any]]) -> None:
    for r in three:
        assert r[key]["error"] is None, r[key]["error"]
        assert r[key]["stepped"] == [True] * STEPS
        assert all(torch.isfinite(p).all() for p in r[key]["params"])
    for pa, pb in zip(three[0][key]["params"], three[1][key]["params"]):
        assert torch.equal(pa, pb)
