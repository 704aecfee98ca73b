"""Error-feedback residuals at a membership change (hexagram.elastic.residuals).

Three real ranks on gloo (run_local, with a timeout) wrap a small net with PowerSGD (its
residuals), SparseLoCo (its error buffers) or DeMo (its local momenta), take a step on
different data (so their residuals differ) and apply each policy of
:func:`recenter` for hand-made epochs: a join (replica 2 healed: its residuals must not
count), a loss, and the ``own`` policy that changes nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hexagram.elastic.quorum import Epoch
from hexagram.elastic.residuals import check_policy, lost_member
from hexagram.errors import ConfigError
from hexagram.launch import run_local

JOIN = Epoch(number=4, members=(0, 1, 2), steps=(7, 7, -1), joins=1)  # 2 is healed
ALL = Epoch(number=4, members=(0, 1, 2), steps=(7, 7, 7), joins=0)


def _flat(model: Any) -> torch.Tensor:
    from hexagram.elastic.state import residual_tensors

    found = residual_tensors(model.algorithm_state_dict())
    return torch.cat([t.reshape(-1).double() for t in found.values()])


#: algorithm -> (config, SGD momentum): every one holds per-rank state after one step
ALGORITHMS = {"powersgd": ({"rank": 1, "start_iter": 0}, 0.0),
              "sparseloco": ({"period": 1, "density": 0.25, "chunk": 64}, 0.0),
              "decoupled_momentum": ({"chunk": 8, "k": 2}, 0.9)}


def _rank(algo: str) -> dict[str, Any]:
    import torch.distributed as dist

    import hexagram as hx
    from hexagram.elastic.collectives import setup_communicator
    from hexagram.elastic.residuals import recenter

    hx.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    config, momentum = ALGORITHMS[algo]
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=momentum)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(algo, **config))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    opt.step()  # SparseLoCo's round (period 1) fills its error buffers
    saved = model.algorithm_state_dict()
    before, out = _flat(model), {}
    cases = {"join": (JOIN, {0: (0, 1), 1: (0, 1), 2: None}, "reset"),
             "mean_after_loss": (ALL, {r: (0, 1, 2, 3) for r in range(3)}, "mean"),
             "reset_after_loss": (ALL, {r: (0, 1, 2, 3) for r in range(3)}, "reset"),
             "own": (JOIN, {0: (0, 1), 1: (0, 1), 2: None}, "own")}
    comm = setup_communicator(60.0)
    for name, (epoch, previous, policy) in cases.items():
        model.load_algorithm_state_dict(saved)
        recenter(model, epoch, rank, previous[rank], policy, comm)
        out[name] = _flat(model)
    comm.close()
    model.close()
    return {"before": before, **out}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_recenter_policies_on_real_ranks(algo: str) -> None:
    ranks = run_local(_rank, 3, args=(algo,), timeout=90)
    before = [r["before"] for r in ranks]
    assert before[0].abs().sum() > 0 and not torch.equal(before[0], before[1])
    up_to_date_mean = (before[0] + before[1]) / 2  # replica 2's residuals do not count
    for r in ranks:
        # a join keeps the pending correction of the up-to-date members, on every member
        # (residuals are float32: the mean, taken in float64, is rounded once)
        assert torch.allclose(r["join"], up_to_date_mean, rtol=1e-6, atol=1e-9)
        assert torch.allclose(r["mean_after_loss"], sum(before) / 3, rtol=1e-6, atol=1e-9)
        assert torch.equal(r["join"], ranks[0]["join"])  # the same on every member
        assert not r["reset_after_loss"].any()  # the dead member's deviation is dropped
    for r, own in zip(ranks, before):
        assert torch.equal(r["own"], own)


def test_lost_member_and_bad_policy() -> None:
    assert not lost_member(JOIN, None)  # a fresh replica knows no previous epoch
    assert not lost_member(JOIN, (0, 1))  # 2 joined: nobody lost
    assert lost_member(JOIN, (0, 1, 2))  # 2 came back without its state
    assert lost_member(ALL, (0, 1, 2, 3))  # 3 died
    with pytest.raises(ConfigError, match="reset, mean, own"):
        check_policy("zero")
