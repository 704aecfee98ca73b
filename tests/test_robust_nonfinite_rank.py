"""``robust`` treats a rank whose gradient holds NaN/Inf as Byzantine and trains on.

Three gloo ranks train with ``robust`` (trimmed mean, f=1, the default ``on_nonfinite``
"raise"); at step 1 rank 2's loss is multiplied by NaN (a diverged or faulty rank). Every
rank must train through all steps with no error, finite and identical weights, and
rank 2's momentum (the worker momentum robust takes over) must stay finite: its row of
that step is dropped, not shared as a flag that every rank obeys. With no agreement
collective, the bytes of a step are exactly the priced schedule's (no 8-byte flag).
Under ``allreduce`` the same NaN stops every rank (the sum carries it), as a control.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hexagram.launch import run_local

STEPS, BAD_STEP, BAD_RANK = 4, 1, 2


def _worker(algorithm: str, config: dict[str, Any]) -> dict[str, Any]:
    import hexagram as hx
    from hexagram.errors import HexagramError

    rank = hx.init().rank
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(algorithm, **config))
    gen = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {"rank": rank, "error": None, "steps": 0, "sent": []}
    try:
        for step in range(STEPS):
            x, y = torch.randn(8, 12, generator=gen), torch.randint(0, 3, (8,), generator=gen)
            loss = nn.functional.cross_entropy(model(x), y)
            if step == BAD_STEP and rank == BAD_RANK:
                loss = loss * float("nan")
            before = model.bytes_sent()
            loss.backward()
            out["sent"].append(model.bytes_sent() - before)
            opt.step()
            opt.zero_grad()
            out["steps"] += 1
    except HexagramError as exc:
        out["error"] = (type(exc).__name__, str(exc))
    out["weights"] = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    state = model.algorithm_state_dict()
    out["momentum_finite"] = all(bool(m.isfinite().all())
                                 for m in state.get("worker", {}).get("buffers", {}).values())
    out["wire"] = _priced(model)
    model.close()
    return out


def _priced(model: Any) -> int:
    """Bytes one step sends by the cost model's schedule for this wrapper's buckets."""
    from hexagram.cost.schedule import layout_of, wire_bytes

    return wire_bytes(model.algorithm, layout_of(model.buckets), 3)


def test_a_nan_rank_is_dropped_and_every_rank_trains_on() -> None:
    outcomes = run_local(_worker, 3, args=("robust", {"aggregator": "trimmed_mean", "f": 1}),
                         timeout=150)
    for out in outcomes:
        assert out["error"] is None, out["error"]
        assert out["steps"] == STEPS, out
        assert bool(out["weights"].isfinite().all()), f"rank {out['rank']}"
        assert out["momentum_finite"], f"rank {out['rank']}'s worker momentum took the NaN"
        assert out["sent"] == [out["wire"]] * STEPS, (out["sent"], out["wire"])
    for out in outcomes[1:]:
        assert torch.equal(out["weights"], outcomes[0]["weights"])


def test_the_same_nan_stops_every_rank_under_allreduce() -> None:
    outcomes = run_local(_worker, 3, args=("allreduce", {}), timeout=150)
    for out in outcomes:
        assert out["error"] is not None and out["error"][0] == "NonFiniteGradientError", out
        assert out["steps"] == BAD_STEP, out
