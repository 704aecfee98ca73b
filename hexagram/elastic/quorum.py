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
is applied on every member or on none. Votes are keyed by their index in the epoch, and a
commit records the step it reaches (``"commit 120"``). :meth:`Quorum.form` closes an
epoch when every replica with a fresh heartbeat has registered (at least ``min_size``), or
raises :class:`QuorumError` after ``join_timeout``: never a hang.

One training membership at a time: a heartbeat can go stale while its replica is only
starved of CPU, so a new epoch may close without members of the previous one that are
still training. Closing an epoch therefore first *fences* the previous one
(:meth:`Quorum.fence`: its pending vote is decided ``abort``, so it commits nothing more
and its members come back to register), and an epoch whose members all hold older state
than the fenced epoch reached waits for a replica that holds it (until ``behind_grace`` s
after the last heartbeat of the fenced epoch's members; then they are presumed dead).
Without this, two memberships trained side by side from the same state and finished with
different parameters. A replica left out of a closed epoch asks
to join, so the training members open the next one for it.

Heartbeats carry the sender's wall clock: replicas on different hosts need clocks in sync
well within ``heartbeat_timeout`` (NTP is enough for the default 0.5 s... keep it larger on
hosts without NTP).

Example:
    >>> q = Quorum(store, replica=0, max_size=3, min_size=2)    # doctest: +SKIP
    >>> epoch = q.form(step=0)                                   # doctest: +SKIP
    >>> q.vote(epoch, index=0, step=0, ok=True, timeout=30)      # doctest: +SKIP
    'commit'
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import torch.distributed as dist

from hexagram.elastic.polling_store import poll_keys
from hexagram.errors import CommError, HexagramError

__all__ = ["Epoch", "Quorum", "QuorumError"]

_POLL = 0.01  # seconds between store polls while waiting for a quorum
_HINT_EVERY = 16  # a commit vote in this many records its index for fence()

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
    #: the members' process tokens (which incarnation of each replica is the member)
    tokens: tuple[str, ...] = ()

    def rank_of(self, replica: int) -> int:
        """This replica's rank in the epoch's process group."""
        return self.members.index(replica)


class Quorum:
    """The store protocol of live mode (see the module doc).

    Args:
        store: the job's store (every replica's client of the same server), prefixed.
        replica: this process's stable id in ``[0, max_size)``.
        max_size: replica ids that may ever take part.
        min_size: smallest membership that may train; fewer => :class:`QuorumError`.
        heartbeat_timeout: a heartbeat older than this marks its replica dead.
        join_timeout: how long :meth:`form` may wait for ``min_size`` live replicas.
        behind_grace: how long an epoch whose members all hold older state than the
            previous epoch reached waits for a replica holding that state (default: 10
            heartbeat timeouts); then those replicas count as dead.
    """

    def __init__(self, store: dist.Store, replica: int, max_size: int, min_size: int,
                 heartbeat_timeout: float = 0.5, join_timeout: float = 60.0,
                 behind_grace: float | None = None, token: str | None = None) -> None:
        self.store, self.replica = store, replica
        self.max_size, self.min_size = max_size, min_size
        self.heartbeat_timeout, self.join_timeout = heartbeat_timeout, join_timeout
        self.behind_grace = 10 * heartbeat_timeout if behind_grace is None else behind_grace
        self._token = token or uuid.uuid4().hex  # tells this process from earlier ones
        self._holders_seen = 0.0  # form(): when a member of the previous epoch last beat

    @property
    def token(self) -> str:
        """This process's token (in its registrations and heartbeats)."""
        return self._token

    # -- liveness --------------------------------------------------------------------
    def alive(self) -> set[int]:
        """Replicas whose heartbeat is fresh."""
        return set(self._beats())

    def _beats(self) -> dict[int, str]:
        """The token of every replica whose heartbeat is fresh ("" from a heartbeat
        without one)."""
        keys = [f"hb/{r}" for r in range(self.max_size)]
        present = [r for r, k in enumerate(keys) if self.store.check([k])]
        now, live = time.time(), {}
        for r in present:
            when, _, token = self.store.get(f"hb/{r}").decode().partition(" ")
            if now - float(when) < self.heartbeat_timeout:
                live[r] = token
        return live

    def members_alive(self, epoch: Epoch) -> bool:
        """Whether every member of ``epoch`` is alive: its heartbeat is fresh and comes
        from the process that registered for the epoch (not from a restart of a member
        that died: that one keeps the replica's heartbeat fresh, never the membership)."""
        beats = self._beats()
        tokens = epoch.tokens or ("",) * len(epoch.members)
        return all(m in beats and (not t or beats[m] in ("", t))
                   for m, t in zip(epoch.members, tokens))

    def wait_key(self, key: str, timeout: float) -> bool:
        """True once ``key`` exists, False after ``timeout`` s. Polled with ``check``
        (:func:`~hexagram.elastic.polling_store.poll_keys`): ``store.wait`` with a timeout
        this short cancels its wait on the server when it expires, and a key set during
        that cancel left the waiter blocked for seconds (watchers missed an abort for 5 s,
        torch 2.13)."""
        return poll_keys(self.store, [key], timeout)

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
        self.store.set(f"{base}r{self.replica}", f"{step} {self._token}")
        start = time.monotonic()
        deadline = start + self.join_timeout
        need = self.min_size if min_size is None else min_size
        self._holders_seen = start  # the grace counts from the fenced members' last beat
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
                      record["joins"], tuple(record["tokens"]))
        if self.replica not in epoch.members:
            return None
        # this process's registration, not an earlier incarnation's of the same replica
        return epoch if record["tokens"][epoch.rank_of(self.replica)] == self._token else None

    def _try_close(self, number: int, need: int) -> None:
        """Close the epoch if every live replica registered and there are enough, after
        fencing the previous epoch; not while its members all hold older state than the
        previous epoch reached, until ``behind_grace`` s after the last heartbeat of the
        previous epoch's members (see the module doc): counted from the start of the
        wait, a holder frozen for 1 s late in a long wait could be given up at once, and
        the step it held lost."""
        base = f"e{number}/"
        registered = {r for r in range(self.max_size) if self.store.check([f"{base}r{r}"])}
        beats = self._beats()
        if self._previous_alive(number, beats):
            self._holders_seen = time.monotonic()
        live = set(beats) | {self.replica}
        if not live <= registered or len(registered & live) < need:
            return
        members = sorted(registered & live)
        joins = self.joins()
        registrations = [self.store.get(f"{base}r{r}").decode().split() for r in members]
        steps = [int(step) for step, _ in registrations]
        tokens = [token for _, token in registrations]
        head = self.fence(number - 1) if number > 1 else None
        if head is not None and max(steps) < head:
            if time.monotonic() - self._holders_seen <= self.behind_grace:
                return  # the replicas holding step `head` are starved or dead: wait
            self._check_not_left_behind(number - 1, head, max(steps))
        record = json.dumps({"members": members, "steps": steps, "joins": joins,
                             "tokens": tokens})
        self.store.compare_set(f"{base}members", "", record)
        self._raise_epoch(number)

    def _previous_alive(self, number: int, beats: dict[int, str]) -> bool:
        """Whether a holder of epoch ``number - 1``'s newest state has a fresh heartbeat
        in ``beats``: a member that was up to date when it closed (the process registered
        for it, not a restart of it). Members it was to heal do not count: if its set-up
        failed (its source died) they hold nothing newer, and waiting on them held the
        next epoch until ``join_timeout``; if it committed, they register that state."""
        key = f"e{number - 1}/members"
        if number <= 1 or not self.store.check([key]):
            return False
        record = json.loads(self.store.get(key).decode())
        tokens = record.get("tokens") or [""] * len(record["members"])
        top = max(record["steps"])
        return any(m in beats and (not t or beats[m] in ("", t))
                   for m, t, s in zip(record["members"], tokens, record["steps"]) if s == top)

    def leave(self, step: int) -> None:
        """Record that this replica finished at ``step`` (:meth:`LiveTrainer.close`)."""
        self.store.set(f"closed/{self.replica}", str(step))

    def _check_not_left_behind(self, previous: int, head: int, newest: int) -> None:
        """Raise when a member of epoch ``previous`` finished holding step ``head``: an
        epoch at step ``newest`` < ``head`` would train on and finish with other
        parameters than the replica that left (nobody can bring it up to date)."""
        record = json.loads(self.store.get(f"e{previous}/members").decode())
        for r in record["members"]:
            if self.store.check([f"closed/{r}"]) \
                    and int(self.store.get(f"closed/{r}").decode()) >= head:
                raise QuorumError(
                    f"live mode: replica {r} finished at step {head} or later while this "
                    f"membership holds step {newest} at best: it cannot be brought up to "
                    "date, and training on would end with different parameters. Restart "
                    "from a checkpoint")

    def _raise_epoch(self, number: int) -> None:
        """``epoch`` := max(``epoch``, number): a closer delayed after its compare_set must
        not move it back over a newer epoch."""
        current = self.last_epoch()
        while current < number:
            expected = str(current) if current else ""
            current = int(self.store.compare_set("epoch", expected, str(number)).decode())

    def fence(self, number: int) -> int | None:
        """End epoch ``number`` for good: decide its pending vote ``abort`` (a member still
        training in it stops at that vote) and return the newest step its members held:
        the step its last commit reached, else the newest step at its closing (None: it
        never closed). Idempotent; at most ``_HINT_EVERY`` + 1 store round trips (the
        walk starts at the last commit a voter recorded)."""
        base = f"e{number}/"
        if not self.store.check([f"{base}members"]):
            return None
        head = max(json.loads(self.store.get(f"{base}members").decode())["steps"])
        index = int(self.store.get(f"{base}last").decode()) \
            if self.store.check([f"{base}last"]) else 0
        while True:
            decision = self.store.compare_set(f"{base}v{index}/decision", "", "abort")
            word, _, reached = decision.decode().partition(" ")
            if word == "abort":
                return head
            head = max(head, int(reached))
            if word == "commit+join":  # its members left after this commit
                return head
            index += 1

    def assemble(self, epoch: Epoch, timeout: float, stage: str = "ready") -> None:
        """Wait until every member of ``epoch`` is ready to build its process group
        (``stage`` ``"ready"``; ``"healed"``: ready to build the wrapper, whose subgroups
        have a rendezvous of their own).

        A member that dies between the epoch's closing and its group's set-up would leave
        the others in the group's rendezvous until its timeout (30 s by default); here a
        stale heartbeat ends the wait at once. The outcome is decided once for all members
        (``compare_set``, as the commit vote): either all build the group or none does.

        Raises:
            CommError: a member's heartbeat went stale first (form the next epoch).
            QuorumError: not every member arrived within ``timeout`` s, all alive.
        """
        base = f"e{epoch.number}/{stage}/"
        self.store.set(f"{base}{self.replica}", "1")
        keys, decision = [f"{base}{r}" for r in epoch.members], f"{base}decision"
        deadline = time.monotonic() + timeout
        while not self.store.check([decision]):
            if self.store.check(keys):
                self.store.compare_set(decision, "", "ok")
            elif not self.members_alive(epoch):
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
    def vote(self, epoch: Epoch, index: int, step: int, ok: bool, timeout: float) -> str:
        """This member's vote number ``index`` of ``epoch`` (counted from 0 on every
        member), on the step that takes it from ``step`` to ``step + 1``; returns the
        decision every member reads: ``"commit"``, ``"commit+join"`` or ``"abort"``.

        Raises:
            QuorumError: no decision within ``timeout`` s with every member alive (a
                member froze without its heartbeat going stale).
        """
        key = f"e{epoch.number}/v{index}/"
        if not ok:
            self.store.compare_set(f"{key}decision", "", "abort")
        elif int(self.store.add(f"{key}ok", 1)) == len(epoch.members):
            outcome = "commit+join" if self.joins() > epoch.joins else "commit"
            proposal = f"{outcome} {step + 1}"
            decided = self.store.compare_set(f"{key}decision", "", proposal).decode()
            if decided == proposal and index % _HINT_EVERY == 0:  # where fence() starts
                self.store.set(f"e{epoch.number}/last", str(index))
        deadline = time.monotonic() + timeout
        wait = max(self.heartbeat_timeout / 4, 0.02)
        while True:
            if self.wait_key(f"{key}decision", wait):
                return self.store.get(f"{key}decision").decode().partition(" ")[0]
            if not self.members_alive(epoch):
                self.store.compare_set(f"{key}decision", "", "abort")
            elif time.monotonic() > deadline:
                raise QuorumError(
                    f"live mode: no decision on step {step} (vote {index}) of epoch "
                    f"{epoch.number} within "
                    f"{timeout:.0f} s although members {list(epoch.members)} look alive")
