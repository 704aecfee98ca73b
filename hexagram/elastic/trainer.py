"""Live mode: survivors keep training when a rank dies, and a restarted rank rejoins.

``hx.elastic.live(module, optimizers, algorithm=...)`` returns a :class:`LiveTrainer`. Each
:meth:`LiveTrainer.run_step` runs the user's forward/backward on the current membership,
then a commit vote on the job's c10d store (:mod:`hexagram.elastic.quorum`) decides, the
same on every member, whether the step is applied:

- gradient algorithms vote every step, *before* the optimizer step: a failed step is
  dropped on every member and never half-applied (the algorithm state it touched, e.g.
  error-feedback residuals, is rolled back);
- weight algorithms (local SGD, DiLoCo, decentralized) vote only on steps that
  communicated (their averaging rounds): the round runs inside the optimizer step, so the
  state before the step is kept and restored if the round is aborted;
- a gloo connection error (a dead peer) makes the member vote ``abort`` at once; a member
  that died without breaking a collective is noticed when its heartbeat goes stale.

After an abort, or when a replica asked to join, the members form a new *epoch*: a new
gloo process group for the new membership, a new wrapper around the same module and
optimizers, and healing: members behind the newest one (a restarted replica) receive the
model, the optimizers **and the algorithm state** from an up-to-date member, and every
member's error-feedback residuals are re-centred (:mod:`hexagram.elastic.residuals`: the
members' mean; zero after a member was lost). If no member
has training state (every replica just started) and ``checkpoint_dir`` is given, the newest
durable checkpoint (:func:`hexagram.load_checkpoint`) is loaded instead.

Launch every replica on its own (a dead replica must not take the others down, as
``torchrun --nproc-per-node N`` would), all pointing at one store that outlives them: across
machines, ``hexagram elastic-store`` hosts it and ``hexagram elastic-run`` (or a torchrun of
one process per replica) starts each replica with ``HEXAGRAM_STORE``/``HEXAGRAM_REPLICA``
(:mod:`hexagram.elastic.service`); on one machine ``MASTER_ADDR``/``MASTER_PORT`` may name
it, with ``RANK`` the replica id and ``WORLD_SIZE`` the largest membership. See
docs/elastic.md.

Example:
    >>> import hexagram as hx
    >>> trainer = hx.elastic.live(net, [opt], algorithm="powersgd", min_size=2)
    ... # doctest: +SKIP
    >>> while trainer.step < 1000:                                      # doctest: +SKIP
    ...     x, y = batch(trainer.step, trainer.rank, trainer.size)
    ...     trainer.run_step(lambda model: loss_fn(model(x), y).backward())
    >>> trainer.close()                                                 # doctest: +SKIP
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hexagram.comm.communicator import abort_all
from hexagram.elastic.job_token import check_token
from hexagram.elastic.liveness import Heartbeat, Watcher
from hexagram.elastic.membership import FAILURES, MembershipSetup
from hexagram.elastic.quorum import Epoch, Quorum, QuorumError
from hexagram.elastic.residuals import check_policy
from hexagram.elastic.service import LiveAddress, live_address
from hexagram.elastic.state import collect_rank_state, replica_device
from hexagram.errors import ConfigError

__all__ = ["LiveTrainer", "QuorumError", "live"]


def live(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
         algorithm: str = "allreduce", *, algorithm_config: dict[str, Any] | None = None,
         min_size: int = 1, start_size: int | None = None,
         heartbeat_timeout: float = 0.5, join_timeout: float = 60.0, timeout: float = 30.0,
         checkpoint_dir: str | None = None, checkpoint_every: int = 0,
         residuals: str = "reset", **wrapper_kwargs: Any) -> LiveTrainer:
    """A fault-tolerant trainer of ``module`` (see the module doc; collective start-up).

    Args:
        module, optimizers: the local model (on the CPU or one CUDA device: its tensors
            cross the gloo group there) and its optimizers (kept across memberships).
        algorithm, algorithm_config: a registered name and its settings
            (``hexagram.algorithms.get(algorithm, **algorithm_config)``; a fresh instance
            per membership).
        min_size: fewest members that may train; below it => :class:`QuorumError`.
        start_size: members the first epoch waits for (default: the largest membership,
            ``HEXAGRAM_MAX_REPLICAS`` or ``WORLD_SIZE``).
        heartbeat_timeout: seconds without a heartbeat before a replica counts as dead
            (the stall after a silent failure; gloo errors are noticed at once).
        join_timeout: how long forming a membership may wait for ``min_size`` replicas.
        timeout: limit of every collective and of every vote.
        checkpoint_dir, checkpoint_every: durable checkpoints every N committed steps
            (0: none); loaded when no member has training state.
        residuals: what error-feedback residuals become at a membership change:
            ``"reset"`` (the members' mean; zero after a member was lost), ``"mean"`` or
            ``"own"`` (see :mod:`hexagram.elastic.residuals`).
        wrapper_kwargs: passed to :class:`hexagram.DistributedDataParallel`.

    Raises:
        ConfigError: bad sizes, an unsupported algorithm or a missing store address.
        QuorumError: fewer than ``min_size`` replicas came within ``join_timeout``.
    """
    if not 1 <= min_size <= (min_size if start_size is None else start_size):
        raise ConfigError(f"need 1 <= min_size ({min_size}) <= start_size ({start_size})")
    replica_device(module)  # one CPU or CUDA device, checked before waiting for a store
    address = live_address(timeout=join_timeout)  # sizes first: this may wait for a store
    replica, max_size = address.replica, address.max_size
    start = max_size if start_size is None else start_size
    if not 1 <= min_size <= start <= max_size:
        raise ConfigError(f"need 1 <= min_size ({min_size}) <= start_size ({start}) <= "
                          f"the largest membership ({max_size}: HEXAGRAM_MAX_REPLICAS, the "
                          "store's --max-replicas or WORLD_SIZE)")
    if not isinstance(algorithm, str):
        raise ConfigError("live mode builds a new algorithm per membership: pass its name "
                          f"and algorithm_config={{...}}, not {type(algorithm).__name__}")
    if algorithm == "async":
        raise ConfigError("live mode does not support 'async' (its rounds run in a "
                          "background thread); use 'local_sgd' or 'diloco'")
    spec = (algorithm, dict(algorithm_config or {}))
    check_policy(residuals)
    return LiveTrainer(module, list(optimizers), spec, replica, max_size, min_size,
                       start, heartbeat_timeout, join_timeout, timeout, checkpoint_dir,
                       checkpoint_every, wrapper_kwargs, residuals=residuals,
                       address=address)


def _abort_all_groups() -> None:
    """Abort every process group, closing its sockets now: peers stuck in a collective
    with this rank fail at once. (``destroy_process_group`` leaves a group that the old
    wrapper still references open until it is garbage-collected, and such a peer waits
    out the collective timeout.) ``pg.abort()`` works for gloo in torch 2.13; torch's
    helper for aborting them all is private, hence the fallback. Idempotent: a second
    call (the watcher fires again in the same epoch) does nothing; before, torch's
    ``AssertionError`` ("Process group cannot be None") ended the watcher thread, and a
    later failure then waited out the collective timeout."""
    if not dist.is_initialized():  # aborted already
        return
    abort_all = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort_all is None:
            raise AttributeError("no _abort_process_group")
        abort_all()
    except (AttributeError, RuntimeError, ValueError, AssertionError):
        if dist.is_initialized():
            dist.destroy_process_group()


class LiveTrainer(MembershipSetup):
    """State of one replica in live mode; create it with :func:`live`.

    Attributes:
        model: the current :class:`hexagram.DistributedDataParallel` (rebuilt per epoch).
        step: committed steps so far (the same on every member).
        rank, size: this replica's rank and the membership size in the current epoch.
        replica: the stable id (``RANK`` at launch).
        stats: ``failures``, ``stall_s`` (per recovery), ``heal_s``, ``epochs``, ``votes``
            (commit votes taken: every step for gradient algorithms, rounds for weight
            algorithms), ``memberships`` (per epoch set up: its number, members, their
            registered steps, this replica's step after set-up, the heal source and the
            set-up's phases), ``failed_setups`` (set-ups a failure cut short: where).
    """

    def __init__(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                 algorithm: tuple[str, dict[str, Any]], replica: int, max_size: int, min_size: int,
                 start_size: int, heartbeat_timeout: float, join_timeout: float,
                 timeout: float, checkpoint_dir: str | None, checkpoint_every: int,
                 wrapper_kwargs: dict[str, Any], *, residuals: str = "reset",
                 address: LiveAddress | None = None) -> None:
        self.module, self.optimizers, self.algorithm = module, optimizers, algorithm
        self.device = replica_device(module)  # the data plane's: gloo with its tensors
        self.replica, self.timeout = replica, timeout
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self._residuals = residuals
        self._wrapper_kwargs = wrapper_kwargs
        self._members: tuple[int, ...] | None = None  # of the last epoch set up
        self._phases: dict[str, float] = {}  # of the set-up in progress
        self._left_s = 0.0  # how long leaving the last membership took
        self.stats: dict[str, Any] = {"failures": 0, "stall_s": [], "heal_s": [],
                                      "epochs": 0, "votes": 0, "memberships": [],
                                      "failed_setups": []}
        self._setup_began = time.monotonic()
        address = address or live_address(timeout=join_timeout)
        host, port, prefix = address.host, address.port, address.prefix
        self._root = dist.TCPStore(host, port, is_master=False,
                                   timeout=timedelta(seconds=join_timeout),
                                   wait_for_workers=False)
        check_token(self._root, address.job, address.token)  # refuse before any key
        self._store = dist.PrefixStore(prefix, self._root)
        self.quorum = Quorum(self._store, replica, max_size, min_size, heartbeat_timeout,
                             join_timeout)
        self._heartbeat = Heartbeat(host, port, prefix, replica, heartbeat_timeout / 5,
                                    self.quorum.token)
        watch_store = dist.PrefixStore(prefix, dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=join_timeout),
            wait_for_workers=False))  # its own client: used from the watcher thread
        self._abort_lock = threading.Lock()  # the watcher vs. the membership change
        self._watcher = Watcher(Quorum(watch_store, replica, max_size, min_size,
                                       heartbeat_timeout, join_timeout,
                                       token=self.quorum.token), self._abort_epoch)
        self.step = -1  # no training state yet
        self._vote = 0  # index of the next commit vote in the current epoch
        self._aborted = 0  # the last epoch the watcher aborted
        self.model: Any = None
        self.epoch: Epoch | None = None
        self._join(own=None, first_size=start_size)

    @property
    def rank(self) -> int:
        """This replica's rank in the current membership."""
        assert self.epoch is not None
        return self.epoch.rank_of(self.replica)

    @property
    def size(self) -> int:
        """Number of members in the current epoch."""
        assert self.epoch is not None
        return len(self.epoch.members)

    # -- one step ------------------------------------------------------------------------
    def run_step(self, closure: Callable[[Any], Any]) -> bool:
        """Run ``closure(model)`` (forward and backward), vote, and apply the step if every
        member succeeded. Returns True when the step was committed (``step`` advanced),
        False when it was dropped (the membership was rebuilt; run the step again).
        """
        weight = self.model.algorithm.kind == "weight"
        snapshot = self._capture() if weight else copy.deepcopy(
            self.model.algorithm_state_dict())
        sent_before = self.model.comm.counter.total
        assert self.epoch is not None
        self._watcher.arm(self.epoch, self._vote)
        try:
            ok = self._attempt(closure, weight)
        finally:
            self._watcher.disarm()
        communicated = not ok or self.model.comm.counter.total != sent_before
        decision = "commit"
        if communicated or not weight:
            self.stats["votes"] += 1
            decision = self.quorum.vote(self.epoch, self._vote, self.step, ok, self.timeout)
            self._vote += 1
        if decision == "abort":
            failed_at = time.monotonic()
            self._zero_grad()
            own = snapshot if weight else {**self._capture(), "algorithm": snapshot}
            self.stats["failures"] += 1
            self._rebuild(own)
            self.stats["stall_s"].append(time.monotonic() - failed_at)
            return False
        if not weight:
            for opt in self.optimizers:
                opt.step()
        self._zero_grad()
        self.step += 1
        if decision == "commit+join":
            self._rebuild(self._capture())
        self._maybe_checkpoint()
        return True

    def _attempt(self, closure: Callable[[Any], Any], weight: bool) -> bool:
        try:
            closure(self.model)
            if weight:
                for opt in self.optimizers:
                    opt.step()
        except FAILURES:
            return False
        return True

    def _zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()

    def _capture(self) -> dict[str, Any]:
        state = collect_rank_state(self.model, self.optimizers, self.step, None)
        return copy.deepcopy(state)

    def _maybe_checkpoint(self) -> None:
        if not self.checkpoint_dir or not self.checkpoint_every \
                or self.step % self.checkpoint_every:
            return
        from hexagram.elastic.checkpoint import save_checkpoint

        try:
            save_checkpoint(self.checkpoint_dir, self.model, self.optimizers, step=self.step,
                            keep=2)
        except FAILURES:  # a member died while saving: nothing was committed
            self._rebuild(self._capture())

    # -- membership ----------------------------------------------------------------------
    def _rebuild(self, own: dict[str, Any]) -> None:
        """Leave the current epoch (its group is broken or too small) and join the next."""
        began = time.monotonic()
        self._teardown()
        self._left_s = time.monotonic() - began
        self._join(own, first_size=None)

    def _abort_epoch(self, epoch: Epoch) -> None:
        """The watcher saw ``epoch`` fail while a step ran: wake this rank's collective
        waits now (:func:`abort_all`; gloo's asynchronous work ignores a group abort) and
        close its process groups, so a survivor stuck in a round with a dead peer votes
        instead of waiting out the collective timeout."""
        with self._abort_lock:
            if self.epoch is not epoch:
                return  # the membership already changed: nothing of it is pending
            self._aborted = epoch.number  # a set-up failing now failed for this reason
            abort_all(f"live mode: a member of epoch {epoch.number} failed")
            _abort_all_groups()

    def _teardown(self) -> None:
        with self._abort_lock:
            # abandon whatever the old membership left in flight: closing must not wait
            # on a collective with a dead peer, nor destroy a group whose threads are stuck
            abort_all("live mode: leaving the membership")
            if dist.is_initialized():
                _abort_all_groups()
            if self.model is not None:
                try:
                    self.model.close()
                except Exception:  # a broken communicator; the wrapper is discarded
                    pass
                self.model = None

    def close(self) -> None:
        """Leave the job: record the step this replica finished at (a membership that
        is behind it must not train on: :class:`QuorumError`), stop the heartbeat,
        release the wrapper and the process group."""
        try:
            self.quorum.leave(self.step)
        except (RuntimeError, dist.DistError):  # the store is gone: the job ended
            pass
        self._heartbeat.stop()
        self._watcher.stop()
        self._teardown()
