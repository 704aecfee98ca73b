"""How a live-mode replica enters a membership: form the epoch, build its group, heal.

:class:`MembershipSetup` is the part of :class:`hexagram.elastic.trainer.LiveTrainer` that
runs between two epochs (the trainer keeps the step loop, the teardown and the abort):

1. :meth:`MembershipSetup._join`: register for the next epoch until one closes with this
   replica in it (:meth:`hexagram.elastic.quorum.Quorum.form`);
2. :meth:`MembershipSetup._setup`: the epoch's gloo process group, then, on an abortable
   set-up communicator (:mod:`hexagram.elastic.collectives`) watched by the step watcher,
   the model check, the healing broadcast to members behind the newest one, a fresh
   wrapper and the re-centred error-feedback residuals.

Where the time goes is recorded per membership in ``stats["memberships"][i]["phases"]``
(seconds): ``teardown`` (leaving the last one), ``form``, ``assemble``, ``group``,
``check``, ``heal``, ``healed``, ``wrapper``, ``recenter``; a set-up that failed (a member
died or froze in it) in ``stats["failed_setups"]``, with the phases it got through.

Example:
    >>> trainer = hexagram.elastic.live(net, [opt], "powersgd")  # doctest: +SKIP
    >>> trainer.stats["memberships"][-1]["phases"]["group"]      # doctest: +SKIP
    0.024
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hexagram.elastic import collectives
from hexagram.elastic.liveness import Watcher
from hexagram.elastic.polling_store import PollingStore
from hexagram.elastic.quorum import Epoch, Quorum
from hexagram.elastic.residuals import recenter
from hexagram.elastic.state import CheckpointError, apply_rank_state, without_residuals
from hexagram.errors import CommError

__all__ = ["FAILURES", "MembershipSetup"]

#: What a peer's death raises in a step or a set-up (live mode forms the next epoch).
FAILURES = (CommError, CheckpointError, dist.DistError)
#: The watcher's key while a membership is set up (commit votes count from 0).
_SETUP_VOTE = -1


class _Marks:
    """Seconds between successive calls, recorded into ``phases`` by name."""

    def __init__(self, phases: dict[str, float]) -> None:
        self.phases, self.last = phases, time.monotonic()

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = now - self.last
        self.last = now


class MembershipSetup:
    """Joining and setting up a membership (see the module doc); mixed into the trainer,
    whose attributes it uses."""

    module: nn.Module
    optimizers: list[torch.optim.Optimizer]
    algorithm: tuple[str, dict[str, Any]]
    device: torch.device
    replica: int
    timeout: float
    checkpoint_dir: str | None
    quorum: Quorum
    stats: dict[str, Any]
    step: int
    model: Any
    epoch: Epoch | None
    _store: dist.Store
    _watcher: Watcher
    _abort_lock: threading.Lock
    _aborted: int
    _members: tuple[int, ...] | None
    _residuals: str
    _wrapper_kwargs: dict[str, Any]
    _vote: int
    _phases: dict[str, float]
    _left_s: float
    _setup_began: float
    _group_store: dist.Store
    _teardown: Callable[[], None]  # the trainer's: leave the current membership

    def _join(self, own: dict[str, Any] | None, first_size: int | None) -> None:
        """Form the next epoch with this replica in it, then set up and heal."""
        number = self.epoch.number + 1 if self.epoch is not None \
            else self.quorum.last_epoch() + 1
        left_out = self.epoch is None
        while True:
            first = number == 1 and first_size is not None
            if left_out and not first:  # the training members open an epoch for us
                self.quorum.ask_to_join()
            formed = time.monotonic()
            epoch = self.quorum.form(number, self.step,
                                     min_size=first_size if first else None)
            self._phases = {"teardown": self._left_s, "form": time.monotonic() - formed}
            self._left_s = 0.0
            left_out = epoch is None  # closed without this replica (it looked dead)
            if epoch is not None:
                self.epoch = epoch
                self.stats["epochs"] += 1
                try:
                    self._setup(epoch, own)
                    return
                except Exception as exc:  # a member died while the group was set up or
                    if not isinstance(exc, FAILURES) and self._aborted != epoch.number:
                        raise  # healed (the watcher aborted it: any error then), else a bug
                    self.stats["failures"] += 1
                    self._record_failed_setup(epoch, exc)
                    self._teardown()
            number = max(number, self.quorum.last_epoch()) + 1

    def _record_failed_setup(self, epoch: Epoch, exc: BaseException) -> None:
        """``stats["failed_setups"]``: the epoch, its members, the phases it got through
        (seconds; the last one is where it failed) and the error."""
        self.stats["failed_setups"].append({
            "epoch": epoch.number, "members": list(epoch.members),
            "phases": {k: round(v, 4) for k, v in self._phases.items()},
            "failed_after_s": round(time.monotonic() - self._setup_began, 4),
            "error": f"{type(exc).__name__}: {exc}"[:300]})

    def _setup(self, epoch: Epoch, own: dict[str, Any] | None) -> None:
        """The epoch's process group and wrapper; heal members that are behind."""
        mark = _Marks(self._phases)
        self._setup_began = mark.last
        self._build_group(epoch, mark)
        healed_at = time.monotonic()
        # a member that dies while healing or re-centring leaves the others in a
        # collective: the watcher aborts it when the member's heartbeat goes stale, and
        # the set-up communicator's waits raise at once (collectives.py says why)
        comm = self._setup_communicator(epoch)
        self._watcher.arm(epoch, _SETUP_VOTE)
        try:
            step = self._set_up_state(comm, epoch, own, mark)
        finally:
            self._watcher.disarm()
            comm.close()
        self.step, self._members, self._vote = step, epoch.members, 0
        newest = max(epoch.steps)
        healed = min(epoch.steps) < newest
        if healed:
            self.stats["heal_s"].append(time.monotonic() - healed_at)
        self.stats["memberships"].append({
            "epoch": epoch.number, "members": list(epoch.members),
            "steps": list(epoch.steps), "step": self.step,
            "source": epoch.members[epoch.steps.index(newest)] if healed else None,
            "phases": {k: round(v, 4) for k, v in self._phases.items()}})

    def _build_group(self, epoch: Epoch, mark: _Marks) -> None:
        """Every member arrived (else :class:`CommError`); the epoch's default group."""
        from hexagram.runtime import adopt_group

        self.quorum.assemble(epoch, self.timeout)  # a member lost here: the next epoch
        mark("assemble")
        # its waits poll: gloo's rendezvous sat 6-10 s on blocking ones (polling_store.py).
        # Held here while the epoch's groups live: they reach it through C++ only, and a
        # Python store collected under them fails their next call ("Not implemented").
        store = self._group_store = PollingStore(
            dist.PrefixStore(f"e{epoch.number}/pg/", self._store), self.timeout)
        dist.init_process_group("gloo", store=store, rank=epoch.rank_of(self.replica),
                                world_size=len(epoch.members),
                                timeout=timedelta(seconds=self.timeout))
        if self.device.type == "cuda":  # the thread's current device, as hexagram.init()
            torch.cuda.set_device(self.device)
        adopt_group(self.timeout, device=self.device)  # gloo with CUDA tensors on a GPU
        mark("group")

    def _set_up_state(self, comm: Any, epoch: Epoch, own: dict[str, Any] | None,
                      mark: _Marks) -> int:
        """Check, heal, wrap and re-centre on ``comm``; the step this replica holds then."""
        from hexagram.algorithms import registry
        from hexagram.engine.ddp import DistributedDataParallel

        # the wrapper's own model check and first broadcast (init_sync) are blocking
        # collectives no abort ends: live mode runs them here, on the set-up communicator
        init_sync = bool(self._wrapper_kwargs.get("init_sync", True))
        if init_sync:
            collectives.check_same_model(comm, self.module)
        mark("check")
        own = self._heal(comm, epoch, own)
        mark("heal")
        # the wrapper's subgroups meet in a store rendezvous that no abort ends: a
        # member that died while healing would hold the others there 30 s
        self.quorum.assemble(epoch, self.timeout, stage="healed")
        mark("healed")
        name, config = self.algorithm
        self.model = DistributedDataParallel(
            self.module, optimizers=self.optimizers, algorithm=registry.get(name, **config),
            **{**self._wrapper_kwargs, "init_sync": False})
        mark("wrapper")
        # the step is this replica's only once the set-up succeeded: a replica healed in a
        # set-up that then failed registered the healed step for the next one, was not
        # healed again and kept a fresh algorithm state beside the healed model (the
        # chaos soak saw its set-up digest differ, then a collective of its own off the
        # members' outer-step schedule)
        step = self.step
        if own is not None:
            apply_rank_state(own, self.model, self.optimizers, restore_rng=False)
            step = int(own["step"])
        elif max(epoch.steps) < 0:
            if init_sync:  # a fresh job: every member starts from rank 0's model
                collectives.broadcast_tensors(
                    comm, [*self.module.parameters(), *self.module.buffers()], 0)
            step = self._load_durable()
        recenter(self.model, epoch, self.replica, self._members, self._residuals, comm)
        mark("recenter")
        return step

    def _setup_communicator(self, epoch: Epoch) -> Any:
        """The communicator of ``epoch``'s set-up collectives (made before the watcher is
        armed for the set-up, so an abort reaches it); :class:`CommError` when the epoch
        was aborted already."""
        with self._abort_lock:
            if self._aborted == epoch.number:
                raise CommError(f"live mode: a member of epoch {epoch.number} failed")
            return collectives.setup_communicator(self.timeout)

    def _heal(self, comm: Any, epoch: Epoch, own: dict[str, Any] | None
              ) -> dict[str, Any] | None:
        """Send the newest member's state to the members behind it; returns the state this
        replica applies (``own`` when it is up to date)."""
        newest = max(epoch.steps)
        if newest < 0 or min(epoch.steps) == newest:
            return own
        source = epoch.steps.index(newest)
        state = collectives.broadcast_object(
            comm, own if epoch.rank_of(self.replica) == source else None, source,
            self.device)
        if self.step < newest and state is not None:  # healed from the source:
            return without_residuals(state)  # its residuals are its own debt
        return own

    def _load_durable(self) -> int:
        """Nobody has training state: the newest durable checkpoint, or step 0."""
        if not self.checkpoint_dir:
            return 0
        from hexagram.elastic.checkpoint import load_checkpoint

        step = load_checkpoint(self.checkpoint_dir, self.model, self.optimizers,
                               restore_rng=False, allow_world_size_change=True)
        return 0 if step is None else step
