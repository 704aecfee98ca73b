"""The quorum's set-up barrier (:meth:`Quorum.assemble`) on a real c10d store, one process.

A member of a freshly closed epoch that dies before building its process group must not
hold the others in the group's rendezvous until its timeout: its stale heartbeat ends the
wait at once, and the members form the next epoch.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from hexagram.elastic.liveness import Watcher
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


# -- one training membership at a time (replicas once finished disagreeing) -----------
def _clients(port: int, replicas: range, **kwargs: float) -> list[Quorum]:
    """One Quorum per replica, each on its own client of the store at ``port``."""
    return [Quorum(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False),
                   r, max_size=4, min_size=2, heartbeat_timeout=0.5, join_timeout=20,
                   **kwargs) for r in replicas]


class _Beating:
    """Keeps the heartbeats of the replicas in ``live`` fresh from a thread (as each
    replica's :class:`Heartbeat` would); the others' are left to go stale."""

    def __init__(self, port: int) -> None:
        self.live: set[int] = set()
        self._store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            _beat(self._store, *sorted(self.live))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _epoch_of_two_at_step_10(store: dist.TCPStore, quorums: list[Quorum]) -> Epoch:
    """Replicas 0 and 1 form epoch 1 at step 10 and commit one step (vote 0)."""
    with ThreadPoolExecutor(2) as pool:
        epochs = list(pool.map(lambda q: q.form(1, 10, min_size=2), quorums[:2]))
        assert epochs[0] == epochs[1] and epochs[0] is not None
        decisions = list(pool.map(lambda q: q.vote(epochs[0], 0, 10, True, 5), quorums[:2]))
    assert decisions == ["commit", "commit"]
    return epochs[0]


@pytest.mark.timeout(60)
def test_no_epoch_closes_behind_a_starved_membership_and_that_membership_is_fenced() -> None:
    """Replicas 0 and 1 train (step 11) but are starved: their heartbeats look dead.
    Two restarted replicas (no state) must not form an epoch of their own and train from
    scratch beside them (the two memberships then finish with different parameters):
    the epoch waits, the starved membership's next vote is ``abort`` (it commits nothing
    more), and once 0 and 1 come back the epoch holds all four, healing from step 11."""
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    quorums = _clients(store.port, range(4), behind_grace=30.0)
    beating = _Beating(store.port)
    beating.live |= {0, 1}
    old = _epoch_of_two_at_step_10(store, quorums)
    beating.live = {2, 3}  # 0 and 1 starved: their heartbeats go stale, still in epoch 1
    with ThreadPoolExecutor(4) as pool:
        joiners = [pool.submit(q.form, 2, -1) for q in quorums[2:]]
        time.sleep(1.5)  # three heartbeat timeouts: before the fix epoch 2 closed here
        assert not store.check(["e2/members"]), store.get("e2/members")
        assert quorums[0].vote(old, 1, 11, True, 5) == "abort"  # fenced: no more commits
        beating.live = {0, 1, 2, 3}
        time.sleep(0.2)  # their heartbeats fresh again before they register
        back = [pool.submit(q.form, 2, 11) for q in quorums[:2]]
        epochs = [f.result(timeout=20) for f in joiners + back]
    beating.stop()
    assert len(set(epochs)) == 1 and epochs[0] is not None
    assert epochs[0].members == (0, 1, 2, 3) and epochs[0].steps == (11, 11, -1, -1)


@pytest.mark.timeout(60)
def test_holders_of_the_newest_state_that_stay_dead_are_given_up_after_the_grace() -> None:
    """The same, but 0 and 1 never come back (they died): after ``behind_grace`` the
    restarted replicas form the epoch (and start from a checkpoint or scratch), and the
    dead membership stays fenced."""
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    quorums = _clients(store.port, range(4), behind_grace=0.5)
    beating = _Beating(store.port)
    beating.live |= {0, 1}
    old = _epoch_of_two_at_step_10(store, quorums)
    beating.live = {2, 3}
    with ThreadPoolExecutor(2) as pool:
        epochs = list(pool.map(lambda q: q.form(2, -1), quorums[2:]))
    beating.stop()
    assert epochs[0] == epochs[1] and epochs[0] is not None
    assert epochs[0].members == (2, 3) and epochs[0].steps == (-1, -1)
    assert quorums[0].fence(1) == 11  # its last commit reached step 11
    assert quorums[0].vote(old, 1, 11, True, 5) == "abort"


@pytest.mark.timeout(60)
def test_the_grace_counts_from_the_holders_last_heartbeat() -> None:
    """Holders 0 and 1 of step 11 beat for 1.5 s while 2 and 3 wait (past the 1 s
    grace), then freeze: the grace counts from their last beat, so the epoch waits for
    them instead of closing as soon as they look dead (and losing step 11)."""
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    quorums = _clients(store.port, range(4), behind_grace=1.0)
    beating = _Beating(store.port)
    beating.live |= {0, 1}
    _epoch_of_two_at_step_10(store, quorums)
    with ThreadPoolExecutor(4) as pool:
        joiners = [pool.submit(q.form, 2, -1) for q in quorums[2:]]
        time.sleep(1.5)  # 0 and 1 alive, not registered yet: nothing can close
        beating.live = {2, 3}  # frozen: stale after the heartbeat timeout
        time.sleep(0.3 + quorums[0].heartbeat_timeout)
        assert not store.check(["e2/members"]), store.get("e2/members")
        beating.live = {0, 1, 2, 3}
        time.sleep(0.1)
        back = [pool.submit(q.form, 2, 11) for q in quorums[:2]]
        epochs = [f.result(timeout=20) for f in joiners + back]
    beating.stop()
    assert epochs[0] is not None and len(set(epochs)) == 1
    assert epochs[0].steps == (11, 11, -1, -1)


@pytest.mark.timeout(60)
def test_members_that_were_to_be_healed_are_not_waited_for() -> None:
    """Epoch 1 closes with 0 holding step 10 and 1 just restarted (-1, to be healed); 0
    dies before healing it. 1 (alive: it was a member of epoch 1) and 2 form epoch 2:
    they hold nothing newer than 1 does, so after the grace they start without 0's state,
    instead of waiting for 1 to bring it until ``join_timeout`` (20 s here)."""
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    quorums = _clients(store.port, range(4), behind_grace=0.5)
    beating = _Beating(store.port)
    beating.live |= {0, 1}
    with ThreadPoolExecutor(2) as pool:
        first = list(pool.map(lambda a: quorums[a[0]].form(1, a[1], min_size=2),
                              [(0, 10), (1, -1)]))
    assert first[0] is not None and first[0].steps == (10, -1)
    beating.live = {1, 2}  # 0 died while healing 1
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        epochs = list(pool.map(lambda q: q.form(2, -1), quorums[1:3]))
    beating.stop()
    assert time.monotonic() - started < 10
    assert epochs[0] == epochs[1] and epochs[0] is not None
    assert epochs[0].members == (1, 2) and epochs[0].steps == (-1, -1)


def test_the_epoch_number_never_moves_back() -> None:
    """A closer delayed between closing epoch 4 and recording it must not move the
    newest epoch back under 5 (a joiner would register for a closed epoch)."""
    _store, quorum = _quorum(0)
    quorum._raise_epoch(5)
    quorum._raise_epoch(4)
    assert quorum.last_epoch() == 5


@pytest.mark.timeout(60)
def test_a_restarted_replica_never_takes_its_predecessors_membership() -> None:
    """Replica 1's earlier incarnation registered in epoch 1 (step 10) and died; the new
    process of replica 1, registering for that closed epoch (e.g. from a stale epoch
    number), is told it is not a member, instead of setting up an old group as if it held
    step 10."""
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    quorums = _clients(store.port, range(2))
    beating = _Beating(store.port)
    beating.live |= {0, 1}
    _epoch_of_two_at_step_10(store, quorums)
    restarted = _clients(store.port, range(1, 2))[0]
    assert restarted.form(1, -1) is None
    assert quorums[1].form(1, 10) is not None  # the incarnation that registered still is
    beating.stop()


# -- the watcher fires twice in one epoch (a DiLoCo survivor once stalled 30 s) ------------
def _abort_twice(port: int) -> str:
    """In a fresh process: a gloo group of one, aborted twice the way live mode does."""
    from datetime import timedelta

    from hexagram.elastic.trainer import _abort_all_groups

    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=10))
    _abort_all_groups()
    _abort_all_groups()  # torch asserted "Process group cannot be None" here
    return f"initialized={dist.is_initialized()}"


@pytest.mark.timeout(60)
def test_aborting_the_process_groups_twice_is_harmless() -> None:
    """The watcher aborts the groups when a peer decided ``abort``; between rounds of a
    weight algorithm it can fire again in the same epoch (the trainer commits a local
    step, arms the same vote again). The second abort raised ``AssertionError``, which
    ended the watcher thread: a later failure then waited out the collective timeout."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        assert pool.apply_async(_abort_twice, (free_port(),)).get(45) == "initialized=False"


@pytest.mark.timeout(60)
def test_the_watcher_outlives_an_abort_callback_that_fails() -> None:
    store, quorum = _quorum(0)
    _beat(store, 0, 1)
    calls: list[int] = []

    def on_abort(epoch: Epoch) -> None:
        calls.append(epoch.number)
        if len(calls) == 1:
            raise AssertionError("Process group cannot be None")

    watcher = Watcher(quorum, on_abort)
    epoch = Epoch(2, (0, 1), (5, 5), 0)
    for index in (0, 1):
        watcher.arm(epoch, index)
        store.set(f"e2/v{index}/decision", "abort")
        deadline = time.monotonic() + 10
        while len(calls) <= index and time.monotonic() < deadline:
            time.sleep(0.02)
        watcher.disarm()
    watcher.stop()
    assert calls == [2, 2]
