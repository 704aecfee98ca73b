"""gTop-k of a whole bucket at once: each tensor's own global top-k, one message per edge.

- the segmented merge is, tensor by tensor, the reference merge (sums of ``index_add_``
  into zeros bit for bit, ties to the lower index), with shared indices and ties;
- the segmented collective over 2, 3 and 4 ranks gives, per tensor, the per-tensor
  collective's pairs and inclusion flags bit for bit (the fast CPU path on untied data,
  the device path on tied data), and the same bytes;
- the algorithm's bucket path trains exactly as its tensor-by-tensor path (gradients and
  residuals bit for bit, several steps, tree and recursive doubling).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hexagram.algorithms.compressed import CompressedAlgorithm
from hexagram.algorithms.gtopk import GTopKAlgorithm, GTopKConfig
from hexagram.buckets import Bucket
from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.gtopk_segments import SegmentPlan, merge_segments
from hexagram.launch import run_local

LENGTHS, KS = (7, 30, 1, 50, 12), (2, 5, 1, 9, 3)
PLAN = SegmentPlan.of(LENGTHS, KS)


def _reference(va: torch.Tensor, ia: torch.Tensor, vb: torch.Tensor, ib: torch.Tensor,
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor's merge: ``index_add_`` into zeros, the k largest magnitudes by a stable
    sort (ties: the lower index), in index order."""
    uniq, inverse = torch.unique(torch.cat([ia, ib]), return_inverse=True)
    summed = torch.zeros(uniq.numel(), dtype=va.dtype).index_add_(0, inverse,
                                                                  torch.cat([va, vb]))
    keep = torch.sort(summed.abs(), descending=True, stable=True).indices[:k].sort().values
    return summed[keep], uniq[keep]


def _side(g: torch.Generator, tied: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per tensor of PLAN: (values, local indices) of one rank; ``tied``: small integers
    (ties, exact cancellations, -0.0), else normal draws."""
    values, indices = [], []
    for n, k in zip(LENGTHS, KS):
        indices.append(torch.randperm(n, generator=g)[:k])
        v = torch.randint(-2, 3, (k,), generator=g).float() if tied \
            else torch.randn(k, generator=g)
        v[v == 0] = -0.0
        values.append(v)
    return values, indices


def _bucket_pairs(values: list[torch.Tensor], indices: list[torch.Tensor], shuffle: bool,
                  g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs at bucket positions, in a random order when ``shuffle``."""
    v = torch.cat(values)
    i = torch.cat([ix + s for ix, s in zip(indices, PLAN.starts)])
    if shuffle:
        order = torch.randperm(v.numel(), generator=g)
        v, i = v[order], i[order]
    return v, i


@pytest.mark.parametrize("tied", [False, True])
def test_merge_segments_is_each_tensors_own_merge(tied: bool) -> None:
    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        (va, ia), (vb, ib) = _side(g, tied), _side(g, tied)
        if trial % 3 == 0:  # shared supports, values cancelling exactly
            ib, vb = [i.clone() for i in ia], [-v for v in va]
        v, i = merge_segments(*_bucket_pairs(va, ia, True, g), *_bucket_pairs(vb, ib, True, g),
                              PLAN)
        want = [_reference(*args, k) for *args, k in zip(va, ia, vb, ib, KS)]
        assert torch.equal(i, torch.cat([wi + s for (_, wi), s in zip(want, PLAN.starts)]))
        assert torch.equal(v.view(torch.int32), torch.cat([wv for wv, _ in want])
                           .view(torch.int32)), trial  # bit for bit, signed zeros included
        assert not bool(PLAN.misplaced(i))


def test_plan_rejects_bad_sizes_and_flags_misplaced_indices() -> None:
    with pytest.raises(ValueError, match="one k in"):
        SegmentPlan.of([3, 2], [4, 1])
    with pytest.raises(ValueError, match="int32"):
        SegmentPlan.of([2**31], [1])
    plan = SegmentPlan.of([3, 2], [1, 1])
    assert not bool(plan.misplaced(torch.tensor([2, 3])))
    assert bool(plan.misplaced(torch.tensor([3, 4])))  # tensor 0's pair in tensor 1


def _collective_worker() -> dict[int, list[dict[str, Any]]]:
    """On 4 ranks: per-tensor and segmented collectives over the first 2, 3 and 4 ranks."""
    import torch.distributed as dist

    import hexagram as hx
    from hexagram.comm.gtopk import gtopk_allreduce_tracked
    from hexagram.comm.gtopk_segments import gtopk_allreduce_segments
    from hexagram.compress import packing

    rt = hx.init()
    out: dict[int, list[dict[str, Any]]] = {}
    for size in range(2, rt.world_size + 1):
        group = dist.new_group(list(range(size)), timeout=rt.timeout)
        if rt.rank < size:
            comm = Communicator(group, rt.timeout, f"test-gtopk-seg-{size}")
            rows = []
            for trial, tied in enumerate([False, True, False, True]):
                packing.CPU_FAST_PATHS = not tied  # ties: the device path's rule
                g = torch.Generator().manual_seed(100 * trial + comm.rank)
                values, indices = _side(g, tied)
                before = comm.counter.by_op()
                each = [gtopk_allreduce_tracked(comm, v, i, n).wait()
                        for v, i, n in zip(values, indices, LENGTHS)]
                middle = comm.counter.by_op()
                v, i = _bucket_pairs(values, indices, True, g)
                whole = gtopk_allreduce_segments(comm, v, i, PLAN).wait()
                after = comm.counter.by_op()
                rows.append({"each": [[t.tolist() for t in r] for r in each],
                             "whole": [t.tolist() for t in whole], "sent": i.tolist(),
                             "local": [ix.tolist() for ix in indices],
                             "bytes": [_pairs(middle) - _pairs(before),
                                       _pairs(after) - _pairs(middle)]})
            packing.CPU_FAST_PATHS = True
            out[size] = rows
            comm.close()
        dist.barrier()
    return out


def _pairs(by_op: dict[str, int]) -> int:
    """Bytes of the pairs sent (not the 8-byte fault allreduce each exchange ends with)."""
    return sum(n for op, n in by_op.items() if op != "gtopk.fault")


@pytest.fixture(scope="module")
def collective() -> list[dict[int, list[dict[str, Any]]]]:
    return run_local(_collective_worker, 4, timeout=180)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_segmented_collective_is_the_per_tensor_one(
        world: int, collective: list[dict[int, list[dict[str, Any]]]]) -> None:
    for rank in range(world):
        for row in collective[rank][world]:
            gv, gi, mine = row["whole"]
            assert gv == [x for r in row["each"] for x in r[0]]
            assert gi == [x + s for r, s in zip(row["each"], PLAN.starts) for x in r[1]]
            # included, over the caller's (shuffled) order: each tensor's own flags
            flags = {p + s: f for r, s, idx in zip(row["each"], PLAN.starts, row["local"])
                     for p, f in zip(idx, r[2])}
            assert mine == [flags[p] for p in row["sent"]]
            assert row["bytes"][0] == row["bytes"][1] > 0  # one message, the same bytes


class _PerTensor(GTopKAlgorithm):
    """The tensor-by-tensor path: one tree per tensor (the reference)."""

    def reduce_bucket(self, bucket: Bucket) -> Handle[torch.Tensor]:
        return CompressedAlgorithm.reduce_bucket(self, bucket)


def _train_worker(granularity: str) -> list[list[list[int]]]:
    """Both paths on the same data: each step's gradients, then the residuals (float32
    bits as plain ints: tensors in run_local's queue need the sender alive)."""
    import torch.distributed as dist

    import hexagram as hx

    hx.init(backend="gloo")
    out = []
    for cls in (GTopKAlgorithm, _PerTensor):
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(9 + i, 10 + i) for i in range(5)], nn.Linear(14, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        algo = cls(GTopKConfig(density=0.2, granularity=granularity))
        model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo,
                                           bucket_size_mb=1.0, first_bucket_mb=0.001)
        g = torch.Generator().manual_seed(dist.get_rank() + 7)
        seen = []
        for _ in range(5):
            model(torch.randn(8, 9, generator=g)).square().mean().backward()
            seen.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]).clone())
            opt.step()
            opt.zero_grad()
        res = algo.state_dict()["feedback"]["residuals"]
        seen.append(torch.cat([res[n].reshape(-1) for n in sorted(res)]))
        model.close()
        out.append([t.view(torch.int32).tolist() for t in seen])
    return out


@pytest.mark.parametrize(("world", "granularity"), [(3, "layer"), (4, "layer"),
                                                    (3, "bucket")])
def test_bucket_path_trains_as_the_tensor_by_tensor_path(world: int,
                                                         granularity: str) -> None:
    for rank, (whole, each) in enumerate(run_local(_train_worker, world, (granularity,),
                                                   timeout=180)):
        assert len(whole) == len(each) == 6
        for step, (a, b) in enumerate(zip(whole, each)):
            assert a == b, (rank, step)  # bit for bit
