"""Membership and commit votes of live mode, on the c10d store torchrun already runs.

Every replica (a stable id in ``[0, max_size)``) keeps a heartbeat key fresh from a thread.
Training runs in *epochs*: an epoch is one membership, agreed by :meth:`Quorum.form`, with
its own process group. Inside an epoch every step ends with :meth:`Quorum.vote`:

- a rank whose step failed (a gloo connection error, at once) proposes ``abort``;
- a rank whose step succeeded adds itself to the step's counter; the last one proposes
  ``commit`` (``commit+join`` when a replica asked to join since the epoch formed);
- a rank waiting for the decision proposes ``abort`` as soon as a member's heartbeat is
  stale (a member that died without breaking a collective).

The first proposal wins (``compare_set``), so every member reads the same decision: a step
is applied on every member or on none. :meth:`Quorum.form` closes an epoch when every
replica with a fresh heartbeat has registered (at least ``min_size``), or raises
:class:`QuorumError` after ``join_timeout``: never a hang.

Heartbeats carry the sender's wall clock: replicas on different hosts need clocks in sync
well within ``heartbeat_timeout`` (NTP is enough for the default 0.5 s... keep it larger on
hosts without NTP).

Example:
    >>> q = Quorum(store, replica=0, max_size=3, min_size=2)    # doctest: +SKIP
    >>> epoch = q.form(step=0)                                   # doctest: +SKIP
    >>> q.vote(epoch, step=0, ok=True)                           # doctest: +SKIP
    'commit'
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from hexagram.errors import CommError, HexagramError

__all__ = ["Epoch", "Heartbeat", "Quorum", "QuorumError", "Watcher"]

_POLL = 0.01  # seconds between store polls while waiting for a quorum


class QuorumError(HexagramError):
    """The quorum could not reach its minimum size in time (names who was there)."""


@dataclass(frozen=True)
class Epoch:
    """One agreed membership: ``members`` (replica ids, in rank order) and their steps.

    ``steps[i]`` is the committed step of ``members[i]`` when it registered, or -1 for a
    process with no training state yet (just started).
    """

    number: int
    members: tuple[int, ...]
    steps: tuple[int, ...]
    joins: int  # value of the join counter when the epoch closed

    def rank_of(self, replica: int) -> int:
        """This replica's rank in the epoch's process group."""
        return self.members.index(replica)


class Heartbeat:
    """A daemon thread that writes ``hb/<replica>`` = wall clock every ``interval`` s.

    It uses its own store client, so a busy training thread never delays it.
    """

    def __init__(self, host: str, port: int, prefix: str, replica: int,
                 interval: float) -> None:
        self._store = dist.PrefixStore(prefix, dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=30),
            wait_for_workers=False))
        self._key, self._interval = f"hb/{replica}", interval
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"hexagram-heartbeat-{replica}")
        self._thread.start()

    def beat(self) -> None:
        self._store.set(self._key, repr(time.time()))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.beat()
            except Exception:  # store gone: the job is ending; the trainer will notice
                return

    def stop(self) -> None:
        """Stop beating (others see this replica as dead after the timeout)."""
        self._stop.set()
        self._thread.join(5)


class Quorum:
    """The store protocol of live mode (see the module doc).

    Args:
        store: the job's store (every replica's client of the same server), prefixed.
        replica: this process's stable id in ``[0, max_size)``.
        max_size: replica ids that may ever take part.
        min_size: smallest membership that may train; fewer => :class:`QuorumError`.
        heartbeat_timeout: a heartbeat older than this marks its replica dead.
        join_timeout: how long :meth:`form` may wait for ``min_size`` live replicas.
    """

    def __init__(self, store: dist.Store, replica: int, max_size: int, min_size: int,
                 heartbeat_timeout: float = 0.5, join_timeout: float = 60.0) -> None:
        self.store, self.replica = store, replica
        self.max_size, self.min_size = max_size, min_size
        self.heartbeat_timeout, self.join_timeout = heartbeat_timeout, join_timeout

    # -- liveness --------------------------------------------------------------------
    def alive(self) -> set[int]:
        """Replicas whose heartbeat is fresh."""
        keys = [f"hb/{r}" for r in range(self.max_size)]
        present = [r for r, k in enumerate(keys) if self.store.check([k])]
        now, live = time.time(), set()
        for r in present:
            if now - float(self.store.get(f"hb/{r}").decode()) < self.heartbeat_timeout:
                live.add(r)
        return live

    def joins(self) -> int:
        """How many times a replica asked to join (a counter on the store)."""
        return int(self.store.add("joins", 0))

    def ask_to_join(self) -> None:
        """Tell the training members to open a new epoch at their next step."""
        self.store.add("joins", 1)

    def last_epoch(self) -> int:
        """Number of the newest closed epoch (0: none yet)."""
        if not self.store.check(["epoch"]):
            return 0
        return int(self.store.get("epoch").decode())

    # -- membership --------------------------------------------------------------------
    def form(self, number: int, step: int, min_size: int | None = None) -> Epoch | None:
        """Register for epoch ``number`` and return it once closed (None: closed without
        this replica, try the next one). ``min_size`` overrides the quorum's (the first
        epoch waits for every replica of the launch).

        Raises:
            QuorumError: fewer than ``min_size`` live replicas within ``join_timeout``.
        """
        base = f"e{number}/"
        self.store.set(f"{base}r{self.replica}", str(step))
        deadline = time.monotonic() + self.join_timeout
        need = self.min_size if min_size is None else min_size
        while not self.store.check([f"{base}members"]):
            self._try_close(number, need)
            if self.store.check([f"{base}members"]):
                break
            if time.monotonic() > deadline:
                raise QuorumError(
                    f"live mode: epoch {number} could not reach {need} replicas "
                    f"within {self.join_timeout:.0f} s: live replicas {sorted(self.alive())} "
                    f"of {self.max_size}. Start more replicas, or lower min_size")
            time.sleep(_POLL)
        record = json.loads(self.store.get(f"{base}members").decode())
        epoch = Epoch(number, tuple(record["members"]), tuple(record["steps"]),
                      record["joins"])
        return epoch if self.replica in epoch.members else None

    def _try_close(self, number: int, need: int) -> None:
        """Close the epoch if every live replica registered and there are enough."""
        base = f"e{number}/"
        registered = {r for r in range(self.max_size) if self.store.check([f"{base}r{r}"])}
        live = self.alive() | {self.replica}
        if not live <= registered or len(registered & live) < need:
            return
        members = sorted(registered & live)
        joins = self.joins()
        steps = [int(self.store.get(f"{base}r{r}").decode()) for r in members]
        record = json.dumps({"members": members, "steps": steps, "joins": joins})
        self.store.compare_set(f"{base}members", "", record)
        self.store.set("epoch", str(number))  # epochs close in order: no race on the value

    def assemble(self, epoch: Epoch, timeout: float) -> None:
        """Wait until every member of ``epoch`` is ready to build its process group.

        A member that dies between the epoch's closing and its group's set-up would leave
        the others in the group's rendezvous until its timeout (30 s by default); here a
        stale heartbeat ends the wait at once. The outcome is decided once for all members
        (``compare_set``, as the commit vote): either all build the group or none does.

        Raises:
            CommError: a member's heartbeat went stale first (form the next epoch).
            QuorumError: not every member arrived within ``timeout`` s, all alive.
        """
        base = f"e{epoch.number}/ready/"
        self.store.set(f"{base}{self.replica}", "1")
        keys, decision = [f"{base}{r}" for r in epoch.members], f"{base}decision"
        deadline = time.monotonic() + timeout
        while not self.store.check([decision]):
            if self.store.check(keys):
                self.store.compare_set(decision, "", "ok")
            elif not set(epoch.members) <= self.alive():
                self.store.compare_set(decision, "", "abort")
            elif time.monotonic() > deadline:
                raise QuorumError(f"live mode: members {list(epoch.members)} of epoch "
                                  f"{epoch.number} did not all arrive within {timeout:.0f} s")
            else:
                time.sleep(_POLL)
        if self.store.get(decision).decode() == "abort":
            raise CommError(f"live mode: a member of epoch {epoch.number} "
                            f"({list(epoch.members)}) died before its process group was set up")

    # -- commit vote -------------------------------------------------------------------
    def vote(self, epoch: Epoch, step: int, ok: bool, timeout: float) -> str:
        """This member's vote on ``step``; returns the decision every member reads:
        ``"commit"``, ``"commit+join"`` or ``"abort"``.

        Raises:
            QuorumError: no decision within ``timeout`` s with every member alive (a
                member froze without its heartbeat going stale).
        """
        key = f"e{epoch.number}/s{step}/"
        if not ok:
            self.store.compare_set(f"{key}decision", "", "abort")
        elif int(self.store.add(f"{key}ok", 1)) == len(epoch.members):
            outcome = "commit+join" if self.joins() > epoch.joins else "commit"
            self.store.compare_set(f"{key}decision", "", outcome)
        deadline = time.monotonic() + timeout
        wait = timedelta(seconds=max(self.heartbeat_timeout / 4, 0.02))
        while True:
            try:
                self.store.wait([f"{key}decision"], wait)
                return self.store.get(f"{key}decision").decode()
            except (RuntimeError, TimeoutError):  # DistStoreError on timeout
                pass
            if not set(epoch.members) <= self.alive():
                self.store.compare_set(f"{key}decision", "", "abort")
            elif time.monotonic() > deadline:
                raise QuorumError(
                    f"live mode: no decision on step {step} of epoch {epoch.number} within "
                    f"{timeout:.0f} s although members {list(epoch.members)} look alive")


class Watcher:
    """A thread that, while a step runs, ends a collective stuck on a failed membership.

    A member stuck in a collective (waiting on a peer that will never send: the dead
    rank's connection was never made, or the peer left the step) cannot vote. While a
    step is armed (:meth:`arm` ... :meth:`disarm`), the watcher waits on the step's
    decision key with its own store client: when a peer decided ``abort``, or a member's
    heartbeat went stale, it decides ``abort`` and calls ``on_abort(epoch)`` (which aborts the
    communicators and process groups: the stuck collective fails now, not after its
    timeout).
    """

    def __init__(self, quorum: Quorum, on_abort: Callable[[Epoch], None]) -> None:
        self.quorum, self._on_abort = quorum, on_abort
        self._armed: tuple[Epoch, int] | None = None
        self._lock = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="hexagram-live-watcher")
        self._thread.start()

    def arm(self, epoch: Epoch, step: int) -> None:
        with self._lock:
            self._armed = (epoch, step)
            self._lock.notify()

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._armed is None and not self._stop:
                    self._lock.wait()
                if self._stop:
                    return
                epoch, step = self._armed  # type: ignore[misc]
            try:
                self._watch(epoch, step)
            except Exception:  # store gone: the trainer's own calls report it
                return

    def _watch(self, epoch: Epoch, step: int) -> None:
        q, key = self.quorum, f"e{epoch.number}/s{step}/decision"
        wait = timedelta(seconds=max(q.heartbeat_timeout / 4, 0.02))
        while self._armed == (epoch, step):
            try:
                q.store.wait([key], wait)
            except (RuntimeError, TimeoutError):
                if not set(epoch.members) <= q.alive():
                    q.store.compare_set(key, "", "abort")
                continue
            if q.store.get(key) == b"abort" and self._armed == (epoch, step):
                self._on_abort(epoch)
            with self._lock:
                if self._armed == (epoch, step):
                    self._armed = None
            return
