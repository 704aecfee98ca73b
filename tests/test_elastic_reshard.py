"""The fold rule of a world-size change, single process (hexagram.elastic.reshard)."""

from __future__ import annotations

import pytest
import torch

from hexagram.elastic.reshard import merge_states
from hexagram.elastic.state import CheckpointError, flatten, unflatten


def _state(rank: int) -> dict:
    return {"model": {"w": torch.ones(3)}, "step": 5,
            "algorithm": {"residual": torch.full((2,), float(rank)),
                          "generator": torch.tensor([rank], dtype=torch.uint8),
                          "q": [torch.eye(2)]},
            "rng": {"torch": torch.tensor([rank])}}


def test_shrink_folds_floats_and_keeps_own_rng() -> None:
    old = [_state(r) for r in range(4)]
    merged, notes = merge_states(old, new_rank=2)
    assert torch.equal(merged["algorithm"]["residual"], torch.full((2,), 1.5))  # mean of 0..3
    assert merged["algorithm"]["generator"].item() == 2
    assert torch.equal(merged["algorithm"]["q"][0], torch.eye(2))
    assert merged["rng"]["torch"].item() == 2 and merged["step"] == 5
    assert notes == {"folded": ["algorithm/residual"], "per_rank": ["algorithm/generator"]}


def test_growth_refuses_per_rank_state_naming_it() -> None:
    with pytest.raises(CheckpointError, match=r"'algorithm/generator' is per-rank state.*"
                                              r"resume with at most 2 ranks"):
        merge_states([_state(0), _state(1)], new_rank=2)
    replicated = [{"model": {"w": torch.ones(2)}, "rng": {"t": torch.tensor([r])}}
                  for r in range(2)]
    merged, _ = merge_states(replicated, new_rank=3)  # replicated state grows fine
    assert torch.equal(merged["model"]["w"], torch.ones(2)) and merged["rng"] is None


def test_flatten_round_trip_keeps_nesting_and_values() -> None:
    state = {"a": [torch.arange(3), (1, "x", None)], "b": {"c": torch.zeros(0)}}
    flat = flatten(state, rank=3)
    assert set(flat) == {"r3/a/0", "r3/b/c", "r3/__structure__"}
    back = unflatten(flat, rank=3)
    assert torch.equal(back["a"][0], torch.arange(3)) and back["a"][1] == (1, "x", None)
    assert back["b"]["c"].shape == (0,)
