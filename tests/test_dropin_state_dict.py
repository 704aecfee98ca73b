"""Checkpoints move between PyTorch DDP and Hexagram both ways: ``state_dict()`` has PyTorch
DDP's ``module.`` keys, and ``load_state_dict`` also takes the module's own keys (a plain
module's checkpoint, or one Hexagram saved before it took PyTorch's keys)."""

from __future__ import annotations

import pytest
import torch
from _dropin import single_rank

from hexagram.engine.torch_args import has_bare_keys


def _equal(pair: tuple[list[torch.Tensor], list[torch.Tensor]]) -> bool:
    a, b = pair
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.timeout(120)
def test_checkpoints_round_trip_between_pytorch_ddp_and_hexagram() -> None:
    out = single_rank()
    theirs, ours = out["keys"]
    assert ours == theirs and ours[0] == "module.0.weight"
    assert _equal(out["torch->hexagram"]) and _equal(out["hexagram->torch"])
    assert _equal(out["bare"])
    assert out["mismatch"].startswith("RuntimeError") and "module.nope" in out["mismatch"]


def test_bare_keys_are_told_from_prefixed_ones() -> None:
    class Outer(torch.nn.Module):  # a module whose own child is called "module"
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 2)

    net = Outer()
    assert has_bare_keys(net.state_dict(), net)  # "module.weight" is the module's own key
    assert not has_bare_keys({"module." + k: v for k, v in net.state_dict().items()}, net)
    assert has_bare_keys({"weight": 0, "module.bias": 0}, torch.nn.Linear(2, 2))
    assert not has_bare_keys({}, net)
