"""The final average of a weight algorithm (``synchronize()``) never writes NaN/Inf.

Two ranks train a few local steps of a weight algorithm whose rounds never come (a period
longer than the run), then rank 1's weights turn NaN (a diverged or faulty rank) just
before ``synchronize()``. What the final round or the final mean receives is then NaN:
both ranks must raise the same ``NonFiniteGradientError``, no hang, and rank 0 keeps
finite weights instead of writing the poisoned result. A healthy run's
``synchronize()`` still leaves both ranks with equal, finite weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hexagram.launch import run_local


def _worker(algorithm: str, config: dict[str, Any], poison: bool) -> dict[str, Any]:
    import hexagram as hx
    from hexagram.errors import HexagramError

    rank = hx.init().rank
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(algorithm, **config))
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if poison and rank == 1:
        with torch.no_grad():
            net[0].weight[0, 0] = float("nan")
    out: dict[str, Any] = {"rank": rank, "error": None}
    try:
        model.synchronize()
    except HexagramError as exc:
        out["error"] = (type(exc).__name__, str(exc))
    out["finite"] = all(bool(p.isfinite().all()) for p in net.parameters())
    out["weights"] = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    model.close()
    return out


#: (algorithm, config, what the error says): the round synchronize() runs for the ranks'
#: last local steps sums their outer updates (NaN: caught by the check of what arrived);
#: async averages the weights themselves (NaN: caught by the check of the mean)
CASES = [("local_sgd", {"period": 100}, "the averaged outer update"),
         ("diloco", {"period": 100}, "the averaged outer update"),
         ("async", {"interval_ms": 1000.0}, "non-finite sum in the final average")]


@pytest.mark.parametrize(("algorithm", "config", "begins"), CASES, ids=[c[0] for c in CASES])
def test_a_nan_rank_stops_every_rank_at_the_final_average(algorithm: str,
                                                          config: dict[str, Any],
                                                          begins: str) -> None:
    outcomes = run_local(_worker, 2, args=(algorithm, config, True), timeout=120)
    for out in outcomes:
        assert out["error"] is not None, f"rank {out['rank']} synchronized NaN: {out}"
        kind, message = out["error"]
        assert kind == "NonFiniteGradientError", out
        assert begins in message, out
    assert outcomes[0]["error"] == outcomes[1]["error"]
    assert outcomes[0]["finite"], "rank 0 wrote the poisoned mean into its model"


@pytest.mark.parametrize(("algorithm", "config", "begins"), CASES, ids=[c[0] for c in CASES])
def test_a_healthy_final_average_equalises_the_ranks(algorithm: str, config: dict[str, Any],
                                                      begins: str) -> None:
    outcomes = run_local(_worker, 2, args=(algorithm, config, False), timeout=120)
    assert all(out["error"] is None and out["finite"] for out in outcomes), outcomes
    assert torch.equal(outcomes[0]["weights"], outcomes[1]["weights"])
