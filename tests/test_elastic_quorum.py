"""The quorum's set-up barrier (:meth:`Quorum.assemble`) on a real c10d store, one process.

A member of a freshly closed epoch that dies before building its process group must not
hold the others in the group's rendezvous until its timeout: its stale heartbeat ends the
wait at once, and the members form the next epoch.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from hexagram.elastic.quorum import Epoch, Quorum, QuorumError
from hexagram.errors import CommError
from hexagram.launch import free_port


def _quorum(replica: int) -> tuple[dist.TCPStore, Quorum]:
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    return store, Quorum(store, replica, max_size=3, min_size=2, heartbeat_timeout=0.5)


def _beat(store: dist.TCPStore, *replicas: int, age: float = 0.0) -> None:
    for r in replicas:
        store.set(f"hb/{r}", str(time.time() - age))


def test_assemble_returns_once_every_member_is_ready() -> None:
    store, quorum = _quorum(0)
    _beat(store, 0, 1)
    store.set("e3/ready/1", "1")  # the other member arrived first
    quorum.assemble(Epoch(3, (0, 1), (10, 10), 0), timeout=5)
    assert store.check(["e3/ready/0"])


def test_a_member_dead_before_set_up_ends_the_wait_at_once() -> None:
    store, quorum = _quorum(0)
    _beat(store, 0)
    _beat(store, 2, age=10.0)  # replica 2's heartbeat is stale: it died
    start = time.monotonic()
    with pytest.raises(CommError, match=r"a member of epoch 4 \(\[0, 2\]\) died"):
        quorum.assemble(Epoch(4, (0, 2), (10, 10), 0), timeout=30)
    assert time.monotonic() - start < 5  # not the 30 s timeout
    store.set("e4/ready/2", "1")  # too late: the decision stands for every member
    with pytest.raises(CommError):
        quorum.assemble(Epoch(4, (0, 2), (10, 10), 0), timeout=30)


def test_a_live_member_that_never_arrives_is_a_timeout_error() -> None:
    store, quorum = _quorum(0)
    _beat(store, 0, 1)
    with pytest.raises(QuorumError, match="did not all arrive within 0 s"):
        quorum.assemble(Epoch(5, (0, 1), (10, 10), 0), timeout=0.3)
