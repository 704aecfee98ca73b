"""gTopKAllReduce: tree shape, merge rule, and the collective on 2 to 5 ranks.

The multi-process part runs once on 5 ranks and uses the collective over the first 2, 3, 4
and 5 of them (one spawn instead of four). Per world size it checks that every rank gets
the same k pairs with exactly k distinct indices, that the result is the exact global top-k
where it must be (disjoint supports; identical supports), and that the counted bytes are
2 (P-1) messages of k pairs in total, one message up per non-root rank; and that the
device path (fixed-size merges, no host reads: what CUDA runs) gives the CPU fast path's
pairs and inclusion flags bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hexagram.comm.communicator import Communicator
from hexagram.comm.gtopk import (
    _broadcast_down,
    _reduce_up,
    butterfly,
    gtopk_allreduce,
    gtopk_allreduce_tracked,
    gtopk_bytes,
    merge_topk,
    out_of_range,
    tree_children,
    tree_parent,
)
from hexagram.launch import run_local

K, NUMEL = 16, 200


def test_tree_is_consistent_for_any_size() -> None:
    for size in range(1, 17):
        for r in range(size):
            for c in tree_children(r, size):
                assert tree_parent(c, size) == r
        # every non-root rank is the child of exactly one rank
        kids = sorted(c for r in range(size) for c in tree_children(r, size))
        assert kids == list(range(1, size))
    assert tree_children(0, 5) == [4, 2, 1]
    assert tree_parent(6, 8) == 4 and tree_parent(5, 8) == 4 and tree_parent(4, 8) == 0


def test_merge_sums_shared_indices_and_keeps_largest() -> None:
    va, ia = torch.tensor([5.0, -1.0, 2.0]), torch.tensor([0, 3, 7])
    vb, ib = torch.tensor([-4.0, 3.0, 0.5]), torch.tensor([0, 3, 9])
    v, i = merge_topk(va, ia, vb, ib, k=2)
    got = dict(zip(i.tolist(), v.tolist()))
    # dense sum: {0: 1, 3: 2, 7: 2, 9: 0.5}; top-2 by magnitude among ties 2, 2 -> {3, 7}
    assert got == {3: 2.0, 7: 2.0}


def test_bytes_formula_totals_two_messages_per_edge() -> None:
    """Tree: one message per edge each way. Recursive doubling (sizes 2, 4, 8): every rank
    sends one message per round, log2 P rounds."""
    for size in range(1, 9):
        total = sum(sum(gtopk_bytes(r, size, k=10)) for r in range(size))
        rounds = size.bit_length() - 1
        assert total == (size * rounds if butterfly(size) else 2 * (size - 1)) * 10 * 8
    assert [butterfly(n) for n in range(1, 9)] == [False, True, False, True, False, False,
                                                   False, True]


def _gtopk_worker(trials: int) -> dict[int, list[dict[str, object]]]:
    """On 5 ranks: the collective over the first 2, 3, 4 and 5 ranks (one spawn for all)."""
    import torch.distributed as dist

    import hexagram as hx
    from hexagram.comm.communicator import Communicator

    rt = hx.init()
    out: dict[int, list[dict[str, object]]] = {}
    for size in range(2, rt.world_size + 1):
        group = dist.new_group(list(range(size)), timeout=rt.timeout)  # every rank calls it
        if rt.rank < size:
            comm = Communicator(group, rt.timeout, f"test-gtopk-{size}")
            out[size] = _trials(comm, trials)
            comm.close()
        dist.barrier()
    return out


def _trials(comm: Communicator, trials: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for trial in range(trials):
        shared = torch.Generator().manual_seed(trial)  # same on all ranks
        mine = torch.Generator().manual_seed(100 * trial + comm.rank)
        perm = torch.randperm(NUMEL, generator=shared)
        # Case A: disjoint supports. Case B: identical support, integer values (exact sums).
        # Case C: random overlapping supports.
        cases = {"disjoint": (torch.randn(K, generator=mine),
                              perm[comm.rank * K:(comm.rank + 1) * K]),
                 "same": (torch.randint(-50, 50, (K,), generator=mine).float(), perm[:K]),
                 "overlap": (torch.randn(K, generator=mine),
                             torch.randperm(NUMEL, generator=mine)[:K])}
        before = comm.counter.by_op()
        for name, (values, indices) in cases.items():
            v, i = gtopk_allreduce(comm, values, indices, NUMEL).wait()
            # plain lists: tensors in run_local's queue need the sender alive to unpickle
            row = {"trial": trial, "case": name, "values": values.tolist(),
                   "indices": indices.tolist(), "gv": v.tolist(), "gi": i.tolist()}
            if butterfly(comm.size):  # the tree's result, computed here for comparison
                tv, ti = _broadcast_down(comm, *_reduce_up(comm, values, indices.long(), K), K)
                row.update(tree_gv=tv.tolist(), tree_gi=ti.tolist())
            out.append(row)
        after = comm.counter.by_op()
        rows = out[-len(cases):]
        out.append({"trial": trial, "case": "bytes",
                    "up": after.get("gtopk.reduce", 0) - before.get("gtopk.reduce", 0),
                    "down": after.get("gtopk.broadcast", 0) - before.get("gtopk.broadcast", 0)})
        for row, (values, indices) in zip(rows, cases.values()):
            row["paths"] = [_tracked(comm, values, indices, fast) for fast in (True, False)]
    return out


def _tracked(comm: Communicator, values: torch.Tensor, indices: torch.Tensor, fast: bool
             ) -> list[list[Any]]:
    """The tracked collective's (values, indices, included) with the CPU fast paths on or
    off (off: the device path CUDA takes)."""
    from hexagram.compress import packing

    saved, packing.CPU_FAST_PATHS = packing.CPU_FAST_PATHS, fast
    try:
        v, i, mine = gtopk_allreduce_tracked(comm, values, indices, NUMEL).wait()
    finally:
        packing.CPU_FAST_PATHS = saved
    return [v.tolist(), i.tolist(), mine.tolist()]


def _dense(values: object, indices: object) -> torch.Tensor:
    d = torch.zeros(NUMEL)
    d[torch.tensor(indices)] += torch.tensor(values)
    return d


@pytest.fixture(scope="module")
def gtopk_results() -> list[dict[int, list[dict[str, Any]]]]:
    return run_local(_gtopk_worker, 5, args=(2,), timeout=120)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_gtopk_allreduce_identical_exact_k(
        world: int, gtopk_results: list[dict[int, list[dict[str, Any]]]]) -> None:
    results = [r[world] for r in gtopk_results[:world]]
    for idx in range(len(results[0])):
        rows = [r[idx] for r in results]
        case = rows[0]["case"]
        if case == "bytes":
            ups = [int(r["up"]) for r in rows]
            downs = [int(r["down"]) for r in rows]
            msg = K * 8 * 3  # three collectives per trial, k float32 + int32 pairs each
            if butterfly(world):  # one exchange per round on every rank, nothing down
                assert ups == [msg * (world.bit_length() - 1)] * world
                assert downs == [0] * world
            else:
                assert ups == [0] + [msg] * (world - 1)
                assert sum(ups) + sum(downs) == 2 * (world - 1) * msg
            continue
        ref = _dense(rows[0]["gv"], rows[0]["gi"])
        for r in rows:  # the device path: the fast path's pairs and flags, bit for bit
            fast, device = r["paths"]
            assert device == fast and fast[:2] == [r["gv"], r["gi"]]
        for r in rows[1:]:  # identical on every rank, bit for bit
            assert r["gv"] == rows[0]["gv"] and r["gi"] == rows[0]["gi"]
        if butterfly(world):  # recursive doubling gives the tree's pairs, bit for bit
            assert rows[0]["gv"] == rows[0]["tree_gv"] and rows[0]["gi"] == rows[0]["tree_gi"]
        gi = torch.tensor(rows[0]["gi"])
        assert gi.numel() == K and gi.unique().numel() == K
        total = torch.stack([_dense(r["values"], r["indices"]) for r in rows]).sum(0)
        if case == "disjoint":  # truncation never drops a global winner: exact top-k
            expect = total.abs().topk(K).indices
            assert set(gi.tolist()) == set(expect.tolist())
            assert torch.equal(ref[gi], total[gi])
        elif case == "same":  # one support everywhere: the exact sum
            assert torch.equal(ref, total)
        assert int((ref != 0).sum()) <= K


def _merge_stable_reference(va: torch.Tensor, ia: torch.Tensor, vb: torch.Tensor,
                            ib: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge by ``unique`` and ``index_add_`` into zeros, the k largest magnitudes by a
    stable sort (ties: the lower index first), in index order."""
    uniq, inverse = torch.unique(torch.cat([ia, ib]), return_inverse=True)
    summed = torch.zeros(uniq.numel(), dtype=va.dtype).index_add_(0, inverse,
                                                                  torch.cat([va, vb]))
    keep = torch.sort(summed.abs(), descending=True, stable=True).indices[:k].sort().values
    return summed[keep], uniq[keep]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_merge_is_the_reference_with_ties_to_the_lower_index(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed-size merge (CPU fast paths off, as on CUDA): the sums of ``index_add_``
    into zeros bit for bit (signed zeros, exact cancellations), ties broken by index."""
    from hexagram.compress import packing

    monkeypatch.setattr(packing, "CPU_FAST_PATHS", False)
    g = torch.Generator().manual_seed(5)
    for trial in range(80):
        numel = int(torch.randint(2, 300, (1,), generator=g))
        k = int(torch.randint(1, numel + 1, (1,), generator=g))
        ia, ib = (torch.randperm(numel, generator=g)[:k] for _ in range(2))
        va = torch.randint(-3, 3, (k,), generator=g).to(dtype)
        va[va == 0] = -0.0
        if trial % 2:  # shared support, values cancelling exactly
            ib, vb = ia.clone(), -va
        else:
            vb = torch.randn(k, generator=g).to(dtype)
        v, i = merge_topk(va, ia, vb, ib, k)
        rv, ri = _merge_stable_reference(va, ia, vb, ib, k)
        assert torch.equal(i, ri), trial
        assert torch.equal(v.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           rv.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        assert v.numel() == k and bool((i[1:] > i[:-1]).all())


def test_out_of_range_is_a_device_flag() -> None:
    assert not bool(out_of_range(torch.tensor([0, 5, 9]), 10))
    assert bool(out_of_range(torch.tensor([0, 10]), 10))
    assert bool(out_of_range(torch.tensor([-1, 3]), 10))
    assert not bool(out_of_range(torch.zeros(0, dtype=torch.int64), 10))


def _staging_worker() -> list[bool]:
    """On a gloo group: does a CUDA tensor (a fake one: no GPU needed) take the host
    staging of point-to-point exchanges, and a CPU tensor not?"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import hexagram as hx
    from hexagram.comm.device import needs_host_staging

    rt = hx.init()
    comm = Communicator(None, rt.timeout, "test-gtopk-staging")
    with FakeTensorMode():
        on_gpu = torch.empty(8, dtype=torch.uint8, device="cuda")
    try:
        return [needs_host_staging(on_gpu, comm), needs_host_staging(torch.empty(8), comm)]
    finally:
        comm.close()


def test_recursive_doubling_stages_cuda_tensors_on_gloo() -> None:
    """gTop-k's exchange (recursive doubling) goes through the point-to-point helper of
    hexagram.comm.primitives, which stages CUDA tensors through the host on gloo (gloo's
    send/recv read host memory only: "writev ... Bad address" otherwise)."""
    import inspect

    from hexagram.comm import gtopk, primitives

    source = inspect.getsource(gtopk._recursive_doubling)
    assert "exchange_works(" in source and "batch_isend_irecv" not in source
    assert gtopk.exchange_works is primitives._exchange_works
    assert "needs_host_staging" in inspect.getsource(primitives._exchange_works)
    assert run_local(_staging_worker, 1, timeout=60) == [[True, False]]
