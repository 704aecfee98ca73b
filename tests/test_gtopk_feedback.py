"""gTopKAllReduce tells each rank which of its pairs the global result includes (exactly).

The invariant error feedback relies on: summing, over ranks, each rank's *included* values
at their indices gives the result, so ``applied + residuals == all gradients``. The paper's
rule (clear every local index that won globally) breaks it when a rank's value for a
winning index was dropped in an early merge; the overlapping case below makes that happen.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hexagram.launch import run_local

NUMEL, K, TRIALS = 64, 8, 4


def _worker() -> dict[int, list[dict[str, Any]]]:
    """On 5 ranks: the tracked collective over the first 2, 3, 4 and 5 ranks."""
    import torch.distributed as dist

    import hexagram as hx
    from hexagram.comm.communicator import Communicator
    from hexagram.comm.gtopk import gtopk_allreduce_tracked

    rt = hx.init()
    out: dict[int, list[dict[str, Any]]] = {}
    for size in range(2, rt.world_size + 1):
        group = dist.new_group(list(range(size)), timeout=rt.timeout)
        if rt.rank < size:
            comm = Communicator(group, rt.timeout, f"test-gtopk-ef-{size}")
            rows = []
            for trial in range(TRIALS):
                g = torch.Generator().manual_seed(100 * trial + comm.rank)
                # integer values: every sum is exact whatever the order
                values = torch.randint(-50, 51, (K,), generator=g).float()
                indices = torch.randperm(NUMEL // 4, generator=g)[:K]  # overlapping supports
                gv, gi, mine = gtopk_allreduce_tracked(comm, values, indices, NUMEL).wait()
                rows.append({"values": values.tolist(), "indices": indices.tolist(),
                             "gv": gv.tolist(), "gi": gi.tolist(), "mine": mine.tolist()})
            out[size] = rows
            comm.close()
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def tracked() -> list[dict[int, list[dict[str, Any]]]]:
    return run_local(_worker, 5, timeout=120)


def _dense(values: list[float], indices: list[int]) -> torch.Tensor:
    d = torch.zeros(NUMEL)
    d.index_add_(0, torch.tensor(indices, dtype=torch.long), torch.tensor(values))
    return d


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_included_values_sum_to_the_result(
        world: int, tracked: list[dict[int, list[dict[str, Any]]]]) -> None:
    lost_by_paper_rule = 0
    for trial in range(TRIALS):
        rows = [tracked[r][world][trial] for r in range(world)]
        result = _dense(rows[0]["gv"], rows[0]["gi"])
        included = torch.zeros(NUMEL)
        for row in rows:
            mine = torch.tensor(row["mine"])
            v, i = torch.tensor(row["values"]), torch.tensor(row["indices"])
            included.index_add_(0, i[mine], v[mine])
            won = torch.isin(i, torch.tensor(row["gi"]))
            assert not bool((mine & ~won).any()), "an included pair must have won globally"
            lost_by_paper_rule += int((won & ~mine).sum())
        assert torch.equal(included, result), f"world {world}, trial {trial}"
    if world > 2:  # with 2 ranks one merge decides everything: nothing can be lost
        assert lost_by_paper_rule > 0, "the overlap case should exercise early drops"
    else:
        assert lost_by_paper_rule == 0
