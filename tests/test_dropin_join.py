"""``Join([model])`` and ``model.join(...)`` as PyTorch DDP: a DDP script with uneven inputs
over 2 ranks (BatchNorm buffers, momentum) ends with PyTorch DDP's parameters and buffers
with only its import changed, and ``throw_on_early_termination`` raises PyTorch's errors on
both ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dropin import run_both, single_rank


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return run_both(tmp_path_factory.mktemp("joins"), "joins")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["Join", "join/active"])
def test_uneven_inputs_end_with_pytorch_ddps_model(runs: dict[str, Any], case: str) -> None:
    for rank in (0, 1):
        ref, got = runs["torch"][rank][case], runs["hexagram"][rank][case]
        for key in ("params", "buffers"):
            for a, b in zip(ref[key], got[key], strict=True):
                torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"{case} {key}")
    final = runs["hexagram"]
    assert all(torch.equal(a, b) for a, b in zip(final[0][case]["params"],
                                                  final[1][case]["params"]))


@pytest.mark.timeout(240)
def test_throw_on_early_termination_raises_on_every_rank(runs: dict[str, Any]) -> None:
    errors = [r["throw"].get("error") for r in runs["hexagram"]]
    assert errors == [r["throw"].get("error") for r in runs["torch"]]
    assert errors[0] == "Rank 0 exhausted all inputs."  # the rank that ran out
    assert errors[1] is not None and "exhausted inputs" in errors[1]


@pytest.mark.timeout(120)
def test_weight_algorithms_point_to_their_own_join() -> None:
    out = single_rank()
    assert out["joinable"]
    join, throw = out["Join weight"], out["throw weight"]
    assert join.startswith("ConfigError: ") and "model.join()" in join, join
    assert throw.startswith("ConfigError: ") and "throw_on_early_termination" in throw, throw
