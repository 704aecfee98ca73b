"""The collective layer: primitives against plain arithmetic, byte accounting, peers, overlap."""

from __future__ import annotations

import os

import pytest
import torch

from hexagram.buckets import build_buckets
from hexagram.comm.peers import select_peers
from hexagram.errors import ConfigError
from hexagram.launch import run_local


@pytest.mark.parametrize("kind", ["all", "ring", "shift_one", "random"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_peer_selections_are_symmetric_and_exclude_self(kind: str, size: int) -> None:
    for step in range(2 * size):
        chosen = [select_peers(kind, r, size, step, seed=7) for r in range(size)]
        for r, peers in enumerate(chosen):
            assert r not in peers and len(set(peers)) == len(peers)
            assert all(r in chosen[p] for p in peers), (kind, size, step, chosen)


def test_shift_one_meets_everyone_and_bad_kind_is_named() -> None:
    for size in (4, 5):
        met = {p for s in range(size) for p in select_peers("shift_one", 0, size, s)}
        assert met == set(range(1, size))
    with pytest.raises(ConfigError, match="peers must be one of"):
        select_peers("star", 0, 4)


def test_buckets_respect_caps_dtypes_and_first_bucket() -> None:
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(100))) for i in range(6)]
    params.insert(3, ("d", torch.nn.Parameter(torch.zeros(10, dtype=torch.float64))))
    buckets = build_buckets(params, bucket_bytes=800, first_bucket_bytes=400)
    assert [b.names for b in buckets] == [["p0"], ["p1", "p2"], ["p3", "p4"], ["d"], ["p5"]]
    assert all(len({e.param.dtype for e in b.entries}) == 1 for b in buckets)
    assert [len(b.entries) for b in build_buckets(params, 0)] == [1] * 7


def _primitives_worker() -> dict[str, object]:
    import hexagram as hx
    from hexagram.comm import primitives
    from hexagram.comm.communicator import Communicator
    from hexagram.comm.hierarchical import HostGroups, hierarchical_allreduce
    from hexagram.comm.reduce import reduce
    from hexagram.compress import get

    os.environ["HEXAGRAM_HOST"] = str(int(os.environ["RANK"]) // 2)  # 2 ranks per "host"
    rt = hx.init(timeout=60)
    comm = Communicator(None, rt.timeout, "test")
    p = rt.world_size
    mine = torch.arange(10, dtype=torch.float32) * (rt.rank + 1)
    expected_mean = torch.arange(10, dtype=torch.float32) * (p + 1) / 2
    out: dict[str, object] = {"hosts": rt.hosts}
    out["allreduce"] = primitives.allreduce(comm, mine.clone()).wait()
    out["hier"] = hierarchical_allreduce(comm, HostGroups.from_runtime(rt), mine.clone()).wait()
    out["sg"] = primitives.scatter_gather(comm, mine.clone(), get("fp16")).wait()
    out["fp16"] = reduce(comm, mine.clone(), get("fp16")).wait()
    gathered = primitives.allgather_payloads(comm, get("fp16").compress(mine)).wait()
    out["gather"] = [get("fp16").decompress(g) for g in gathered]
    ring = select_peers("ring", rt.rank, p)
    out["ring"] = (ring, primitives.neighbor_exchange(comm, mine, ring, ring).wait())
    out["expected"] = expected_mean
    out["bytes"] = comm.counter.by_op()
    comm.close()
    return out


def test_primitives_agree_with_arithmetic_and_count_bytes() -> None:
    results = run_local(_primitives_worker, 4, timeout=120)
    for rank, out in enumerate(results):
        assert out["hosts"] == [[0, 1], [2, 3]]
        expected = out["expected"]
        for key in ("allreduce", "hier", "sg", "fp16"):
            assert torch.allclose(out[key], expected, rtol=1e-3), (rank, key)  # type: ignore
        assert [g[1].item() for g in out["gather"]] == [1.0, 2.0, 3.0, 4.0]  # type: ignore
        peers, received = out["ring"]  # type: ignore[misc]
        assert [t[1].item() for t in received] == [float(q + 1) for q in peers]
        sent = out["bytes"]
        assert sent["allreduce"] == 2 * 3 * 40 // 4  # ring: 2 (P-1)/P of 40 bytes
        assert sent["allreduce_compressed"] == 2 * 3 * 20 // 4  # fp16 halves it
        assert sent["allgather_payloads"] == 3 * 20
        assert sent["neighbor_exchange"] == 2 * 40
        # all-to-all of 4 fp16 chunks of 3 elements (10 padded to 12): 3 chunks leave
        assert sent["scatter_gather.alltoall"] == 3 * 6
        assert sent["scatter_gather.allgather"] == 3 * 6
        leader = rank in (0, 2)
        assert sent["hierarchical_allreduce"] == (40 + 40 if leader else 40)


def _overlap_worker() -> list[str]:
    import hexagram as hx
    from hexagram.algorithms.allreduce import AllreduceAlgorithm

    hx.init()
    events: list[str] = []

    class Recording(AllreduceAlgorithm):
        def bucket_ready(self, bucket):  # type: ignore[no-untyped-def]
            events.append(f"launch {bucket.index}")
            return super().bucket_ready(bucket)

    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(4)]
    model = torch.nn.Sequential(*layers)
    for i, layer in enumerate(layers):
        layer.weight.register_post_accumulate_grad_hook(
            lambda _p, i=i: events.append(f"grad {i}"))
    ddp = hx.DistributedDataParallel(model, algorithm=Recording(), bucket_size_mb=0)
    ddp(torch.randn(8, 64)).sum().backward()
    return events


def test_buckets_launch_during_backward_not_after() -> None:
    events = run_local(_overlap_worker, 2, timeout=60)[0]
    # Bucket 0 (last layer's bias) must start before the first layer's gradient exists:
    # communication overlaps the rest of backward.
    assert events.index("launch 0") < events.index("grad 0")
    assert events.index("launch 1") < events.index("grad 0")
    launches = [e for e in events if e.startswith("launch")]
    assert launches == [f"launch {i}" for i in range(8)]  # in order, each exactly once


def _inline_worker() -> dict[str, object]:
    import threading
    import time

    import hexagram as hx
    from hexagram.comm import primitives
    from hexagram.comm.communicator import Communicator

    rt = hx.init(timeout=60)
    comm = Communicator(None, rt.timeout, "inline")
    order: list[str] = []
    caller = threading.current_thread().name

    def slow() -> None:  # a multi-stage job: blocks the issuing thread for a while
        time.sleep(0.3)
        order.append("slow")

    def quick() -> str:
        order.append("quick")
        return threading.current_thread().name

    queued = comm.submit("slow", slow)
    behind = comm.submit("quick", quick, inline=True)  # must wait its turn, not jump ahead
    queued.wait()
    ran_behind_on = behind.wait()
    alone = comm.submit("quick", quick, inline=True).wait()  # nothing queued: runs here
    x = torch.full((4,), float(rt.rank + 1))
    mean = primitives.allreduce(comm, x).wait()  # the inline fast path, across ranks
    comm.close()
    return {"order": order, "behind_on_caller": ran_behind_on == caller,
            "alone_on_caller": alone == caller, "mean": mean.tolist(),
            "expected": (rt.world_size + 1) / 2}


def test_inline_jobs_keep_submission_order_and_skip_the_thread_hand_over() -> None:
    for r in run_local(_inline_worker, 2, timeout=60):
        assert r["order"] == ["slow", "quick", "quick"]
        assert r["behind_on_caller"] is False and r["alone_on_caller"] is True
        assert r["mean"] == [r["expected"]] * 4
