"""Communicator.abort: a wait blocked on a peer that never answers raises CommError at once.

Two real gloo ranks; rank 1 never joins rank 0's collectives (it waits on the store for
rank 0 to finish). Rank 0 blocks in two waits (an asynchronous allreduce, and a job stuck
in the issuing thread) that another thread then aborts. The group's timeout is 60 s and
the run's deadline 40 s: a wait that is not woken fails the run. No wall-clock assertion.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from hexagram.launch import run_local


def _wait_error(handle: Any) -> str:
    from hexagram.errors import CommError

    try:
        handle.wait()
    except CommError as exc:
        return str(exc)
    return "no error"


def _later(fn: Any, *args: Any) -> None:
    threading.Timer(0.3, fn, args).start()


def _abort_worker() -> dict[str, Any]:
    import torch.distributed as dist

    import hexagram as hx
    from hexagram.comm import communicator as cm
    from hexagram.comm import primitives
    from hexagram.errors import CommError

    rt = hx.init(timeout=60)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    # groups of their own: the default one stays clean for the shutdown barrier
    groups = [dist.new_group([0, 1]) for _ in range(2)]  # collective: both ranks
    if rt.rank == 1:  # takes part in nothing else; leaves when rank 0 is done
        store.wait(["abort-test/done"])
        # complete rank 0's abandoned synchronous job, so its issuing thread (joined at
        # interpreter exit) ends now rather than at the 60 s timeout
        dist.all_reduce(torch.ones(4), group=groups[1])
        return {}
    comm = cm.Communicator(groups[0], rt.timeout, "grads")
    out: dict[str, Any] = {}
    _later(comm.abort, "peer 1 is gone")
    out["allreduce"] = _wait_error(primitives.allreduce(comm, torch.ones(8)))
    try:
        comm.submit("allreduce", lambda: None)
    except CommError as exc:
        out["submit"] = str(exc)
    comm.close()  # returns: the issuing thread is not waited for after an abort
    # a job blocked *inside* the issuing thread (a synchronous collective), woken by abort_all
    other = cm.Communicator(groups[1], rt.timeout, "rounds")
    stuck = other.submit("round", lambda: dist.all_reduce(torch.ones(4), group=other.group))
    counted: list[int] = []
    _later(lambda: counted.append(cm.abort_all("membership changed")))
    out["job"] = _wait_error(stuck)
    time.sleep(0.1)
    out["abort_all"], out["aborted"] = counted, (comm.aborted, other.aborted)
    store.set("abort-test/done", "1")
    return out


@pytest.mark.timeout(90)
def test_abort_wakes_blocked_waits_with_a_clear_error() -> None:
    rank0, _ = run_local(_abort_worker, 2, timeout=40)
    assert "communicator 'grads' was aborted: peer 1 is gone" in rank0["allreduce"]
    assert "unusable after an earlier failure" in rank0["submit"]
    assert "communicator 'rounds' was aborted: membership changed" in rank0["job"]
    assert rank0["abort_all"] == [1]  # 'grads' was aborted already: only 'rounds'
    assert rank0["aborted"] == (True, True)
