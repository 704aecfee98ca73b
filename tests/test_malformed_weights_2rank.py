"""What arrives in the weight algorithms (and DGC) is checked: a bad sender stops every rank.

Two ranks train through the real algorithm path; from step ``BAD_STEP`` on, what rank 1
puts on the wire is corrupted: the bytes of its compressed payloads (``dgc``: every top-k
index past the end; ``diloco`` with top-k: the same on its pseudo-gradients; ``local_sgd``
with 8-bit min-max: NaN scales) or, where weights travel in full precision, the tensor it
sends (``decentralized``, to every rank or to its ring neighbour; ``local_sgd``; ``async``'s
background rounds) holds NaN. Both ranks must raise the same
:class:`~hexagram.errors.NonFiniteGradientError` (or its ``MalformedPayloadError``) at the
same step, naming rank 1 where the collective lets it be known and the algorithm keeps what
names it (DGC's step, a ring neighbour), with no raw torch error, no hang (every run has a
deadline) and no NaN/Inf ever written into the model. DGC is also attacked through
:class:`~hexagram.testing.attacks.AttackedAlgorithm`'s byte attacks.
"""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _malformed import BAD_STEP, STEPS, corrupt_buffers, train, wrap
from torch import nn

from hexagram.launch import run_local


def _corrupt(payload: Any, how: str) -> Any:
    tensors = list(payload.tensors)
    if how == "index":  # (values, indices): every index past the end of the tensor
        tensors[-1] = torch.full_like(tensors[-1], 10**6)
    else:  # every floating tensor (scales, values) NaN
        tensors = [t.new_full(t.shape, float("nan")) if t.is_floating_point() else t
                   for t in tensors]
    return replace(payload, tensors=tuple(tensors))


def _sabotage_weights(module: Any, armed: list[bool]) -> None:
    """``module``'s full-precision sends (allreduce, neighbour exchange) carry NaN once
    ``armed[0]`` holds; every other collective (control, buffers) is left alone."""
    real = module.primitives

    def allreduce(comm: Any, tensor: torch.Tensor, average: bool = True) -> Any:
        if armed[0]:
            tensor.fill_(float("nan"))  # the algorithm's own copy (or scratch)
        return real.allreduce(comm, tensor, average)

    def neighbor_exchange(comm: Any, tensor: torch.Tensor, send_to: Any, recv_from: Any
                          ) -> Any:
        bad = torch.full_like(tensor, float("nan")) if armed[0] else tensor
        return real.neighbor_exchange(comm, bad, send_to, recv_from)

    module.primitives = SimpleNamespace(allreduce=allreduce,
                                        neighbor_exchange=neighbor_exchange)


def _sabotage(algorithm: str, how: str, armed: list[bool]) -> None:
    import hexagram.algorithms.async_model_average as asynchronous
    import hexagram.algorithms.decentralized as decentralized
    import hexagram.algorithms.diloco as diloco

    if how != "weights":
        corrupt_buffers(lambda payload: _corrupt(payload, how), armed)
    else:
        _sabotage_weights({"decentralized": decentralized, "async": asynchronous}.get(
            algorithm, diloco), armed)


def _worker(algorithm: str, config: dict[str, Any], how: str) -> dict[str, Any]:
    run = wrap(algorithm, config)
    armed = [False]
    if run.rank == 1:
        _sabotage(algorithm, how, armed)
    if algorithm == "async":  # rounds every 5 ms run in the background meanwhile
        return train(run, armed, 60, after_step=lambda _: time.sleep(0.02), synchronize=True)
    return train(run, armed, STEPS, synchronize=True)


#: (algorithm, its config, corruption, how the error begins, steps after BAD_STEP at which
#: the ranks raise: a round's control collective carries what the round received to the
#: next round). Where the sender cannot be known (a sum), or a round does not keep what
#: would name it (the gathered payloads, through the inner steps), no rank is named.
MALFORMED_FROM_1 = "malformed payload: topk: rank 1 sent"
CASES = [
    ("dgc", {"density": 0.1}, "index", MALFORMED_FROM_1, 0),
    ("decentralized", {}, "weights", "decentralized: the average over the ranks", 1),
    ("decentralized", {"peers": "ring"}, "weights",
     "malformed payload: decentralized: rank 1 sent", 1),
    ("diloco", {"period": 1, "compressor": "topk"}, "index",
     "malformed payload: diloco: a rank sent", 1),
    ("local_sgd", {"period": 1, "compressor": "minmax8"}, "nan",
     "malformed payload: local_sgd: a rank sent", 1),
    ("local_sgd", {"period": 1}, "weights", "algorithm 'local_sgd': the averaged outer", 1),
]


@pytest.mark.parametrize(("algorithm", "config", "how", "begins", "late"), CASES,
                         ids=[f"{c[0]}-{c[2]}-{c[1].get('peers', c[1].get('compressor'))}"
                              for c in CASES])
def test_both_ranks_raise_the_same_error_at_the_same_step(
        algorithm: str, config: dict[str, Any], how: str, begins: str, late: int) -> None:
    outcomes = run_local(_worker, 2, args=(algorithm, config, how), timeout=120)
    for out in outcomes:
        assert out["error"] is not None, f"rank {out['rank']} trained on: {out}"
        kind, message = out["error"]
        malformed = begins.startswith("malformed")
        assert kind == ("MalformedPayloadError" if malformed else "NonFiniteGradientError"), out
        assert message.startswith(begins), out
        assert out["step"] == BAD_STEP + late, out
        assert out["finite"], f"NaN/Inf reached the weights of rank {out['rank']}: {out}"
    assert outcomes[0]["error"] == outcomes[1]["error"]


def test_async_rounds_stop_every_rank_on_a_nan_mean() -> None:
    outcomes = run_local(_worker, 2, args=("async", {"interval_ms": 5.0}, "weights"),
                         timeout=120)
    for out in outcomes:
        assert out["error"] is not None, f"rank {out['rank']} trained on: {out}"
        assert out["error"][0] == "NonFiniteGradientError", out
        assert out["step"] >= BAD_STEP, out
        assert out["finite"], f"NaN/Inf reached the weights of rank {out['rank']}: {out}"
    # the background threads stop at the same round: the same message on both ranks
    assert outcomes[0]["error"] == outcomes[1]["error"]


def _attacked_dgc_worker(attack: str) -> dict[str, Any]:
    import hexagram as hx
    from hexagram.errors import HexagramError
    from hexagram.testing.attacks import AttackConfig, AttackedAlgorithm

    hx.init()
    rank = hx.get_runtime().rank
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    algorithm = AttackedAlgorithm(hx.algorithms.get("dgc", density=0.1, warmup_steps=4),
                                  AttackConfig(name=attack, ranks=(1,)))
    model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algorithm)
    outcome: dict[str, Any] = {"rank": rank, "error": None, "step": None}
    try:
        for step in range(3):
            outcome["step"] = step
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    except HexagramError as exc:
        outcome["error"] = (type(exc).__name__, str(exc))
    except Exception as exc:  # a raw torch error (the attacker's own residual) fails
        outcome["error"] = ("raw " + type(exc).__name__, str(exc))
    outcome["corrupted"] = [c.calls for c in algorithm.corrupting or []]
    outcome["finite"] = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    model.close()
    return outcome


@pytest.mark.parametrize("attack", ["index_out_of_range", "nan_scale", "malformed"])
def test_dgc_under_a_byte_attack_stops_both_ranks_at_the_first_step(attack: str) -> None:
    # DGC encodes with a top-k of the step's density (warm-up), not its ``compressor``:
    # the attack harness corrupts what its encoder returns
    outcomes = run_local(_attacked_dgc_worker, 2, args=(attack,), timeout=120)
    for out in outcomes:
        assert out["error"] is not None and out["error"][0] == "MalformedPayloadError", out
        assert "rank 1 sent" in out["error"][1], out
        assert out["step"] == 0 and out["finite"], out
    assert outcomes[1]["corrupted"][0] >= 1, outcomes[1]  # the attacker's payload, on the wire
    assert outcomes[0]["error"] == outcomes[1]["error"]
