"""One replica of the chaos soak (:mod:`hexagram.bench.chaos`): live mode, a ledger, orders.

The replica trains :func:`hexagram.bench.soak.model_for` with :func:`hexagram.elastic.live`
on the soak's constant global batch and writes a *ledger*, one line per event, flushed at
once (a SIGKILLed replica leaves its ledger up to its last event):

- ``S epoch members digest before after t``: a membership was set up; ``digest`` covers
  everything the members must hold alike right then (model, optimizers and algorithm
  state with its error-feedback residuals for a gradient algorithm; the algorithm state
  with residuals and outer state for a weight algorithm); ``before``/``after``: this
  replica's committed step before and after (``after > before``: it was healed);
- ``C step epoch voted digest t``: a committed step (``step`` reached); ``voted``: the
  members voted on it (every step of a gradient algorithm, the averaging rounds of a
  weight algorithm); ``digest`` (voted commits only): model, optimizers (gradient
  algorithms) and algorithm state without the residuals, which every member of the epoch
  holds alike after a vote;
- ``F kind step t``: a fault fired inside this process (``slow``, ``collective_kill``,
  ``heal_kill``); ``END step digest t`` or ``ERR message t`` when it stops;
- ``P epoch phases t``: where the set-up of a membership spent its time; ``A step
  seconds t``: a step aborted and the rebuild that followed; ``X epoch members phases
  seconds error t``: a set-up a failure cut short (see
  :mod:`hexagram.elastic.membership`).

Orders come from the controller through a shared array (:class:`Board`): the replica reads
its slot between steps (no system call, nothing on the store).
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hexagram.testing.faults import CHAOS_KINDS, FaultInjector

__all__ = ["FIELDS", "Board", "replica_main", "state_digest"]

#: Fields of a replica's slot on the board (doubles).
FIELDS = ("pid", "phase", "step", "order", "kind", "arg", "taken", "fired")
STARTING, TRAINING = 0.0, 1.0
#: Exit status of a replica that gave up with ``QuorumError`` (restarted, not a crash).
GAVE_UP = 3


class Board:
    """A replica's slot in the shared ``array`` (``len(FIELDS)`` doubles per replica)."""

    def __init__(self, array: Any, replica: int) -> None:
        self.array, self.base = array, replica * len(FIELDS)

    def __getitem__(self, field: str) -> float:
        return float(self.array[self.base + FIELDS.index(field)])

    def __setitem__(self, field: str, value: float) -> None:
        self.array[self.base + FIELDS.index(field)] = value

    def take(self) -> tuple[str, float] | None:
        """The controller's newest order not taken yet (kind, argument), marked taken."""
        order = self["order"]
        if order <= self["taken"]:
            return None
        kind, arg = CHAOS_KINDS[int(self["kind"])], self["arg"]
        self["taken"] = order
        return kind, arg


#: Per-rank random generators of a compressed algorithm: seeded by the rank (distinct on
#: purpose: independent stochastic rounding), never compared across replicas.
_PER_RANK = ("generator", "reduce_generator")


def _feed(obj: Any, h: Any, residuals: bool, parent: str = "") -> None:
    """Hash ``obj`` (nested dicts/lists of tensors and plain values) into ``h``; the
    error-feedback residuals (``feedback/residuals``) only when ``residuals``; never the
    per-rank generators."""
    if isinstance(obj, torch.Tensor):
        h.update(obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if ((parent, k) == ("feedback", "residuals") and not residuals) \
                    or k in _PER_RANK:
                continue
            h.update(str(k).encode())
            _feed(v, h, residuals, str(k))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _feed(v, h, residuals)
    else:
        h.update(repr(obj).encode())


def state_digest(trainer: Any, *, model: bool, optimizers: bool, residuals: bool) -> str:
    """A 16-hex-digit BLAKE2b of ``trainer``'s model, optimizers and algorithm state (the
    parts asked for); equal iff bitwise equal (up to the hash)."""
    h = hashlib.blake2b(digest_size=8)
    if model:
        _feed(trainer.module.state_dict(), h, residuals)
    if optimizers:
        _feed([o.state_dict()["state"] for o in trainer.optimizers], h, residuals)
    _feed(trainer.model.algorithm_state_dict(), h, residuals)
    return h.hexdigest()


class _Ledger:
    def __init__(self, path: Path) -> None:
        self.file: TextIO = path.open("w", buffering=1)  # one write per line

    def write(self, *fields: Any) -> None:
        self.file.write(" ".join(str(f) for f in fields) + f" {time.time():.6f}\n")


def _kill_inside(owner: Any, names: tuple[str, ...], replica: int, when: str,
                 on_fire: Callable[[], None]) -> contextlib.ExitStack:
    """SIGKILL this process at its first call of any function of ``owner`` (a module) in
    ``names`` (``when`` it: before or after issuing it); never unarmed (it dies)."""
    stack = contextlib.ExitStack()
    injector = FaultInjector([], replica)
    for name in names:
        stack.enter_context(injector.inside(owner, name, rank=replica, action="sigkill",
                                            when=when, on_fire=on_fire))  # type: ignore[arg-type]
    return stack


def _failed_setups(ledger: _Ledger, failed: list[dict[str, Any]]) -> None:
    """``X epoch members phases seconds error`` per set-up a failure cut short."""
    for f in failed:
        phases = ",".join(f"{k}={v}" for k, v in f["phases"].items())
        ledger.write("X", f["epoch"], ",".join(map(str, f["members"])), phases,
                     f["failed_after_s"], f["error"].replace("\n", " ").replace(" ", "_"))


def _setup_record(ledger: _Ledger, trainer: Any, weight: bool, before: int) -> None:
    assert trainer.epoch is not None
    digest = state_digest(trainer, model=not weight, optimizers=not weight, residuals=True)
    members = ",".join(map(str, trainer.epoch.members))
    ledger.write("S", trainer.epoch.number, members, digest, before, trainer.step)
    phases = trainer.stats["memberships"][-1]["phases"]
    ledger.write("P", trainer.epoch.number, ",".join(f"{k}={v}" for k, v in phases.items()))


def replica_main(replica: int, world: int, port: int, cfg: dict[str, Any], incarnation: int,
                 out: str, data: Any, array: Any, heal_kill: bool) -> None:
    """One incarnation of replica ``replica`` (see the module doc)."""
    from hexagram.bench.soak import model_for
    from hexagram.elastic import live
    from hexagram.elastic.quorum import QuorumError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(replica),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    stacks = (Path(out) / f"stacks{replica}_{incarnation}.txt").open("w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # a stall's why
    board = Board(array, replica)  # its pid there: ready for SIGUSR1
    board["pid"], board["phase"], board["step"] = os.getpid(), STARTING, -1
    ledger = _Ledger(Path(out) / f"ledger{replica}_{incarnation}.txt")

    def fired(kind: str, step: int) -> Callable[[], None]:
        def note() -> None:
            board["fired"] = board["fired"] + 1
            ledger.write("F", kind, step)
        return note

    stack = contextlib.ExitStack()
    if heal_kill:  # the healing broadcast is the first thing a restarted replica receives
        from hexagram.elastic import collectives

        stack.enter_context(_kill_inside(collectives, ("broadcast_object",), replica,
                                         "before", fired("heal_kill", -1)))
    model = model_for(data, seed=cfg["seed"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    try:
        trainer = live(model, [opt], cfg["algorithm"], algorithm_config=cfg["config"],
                       min_size=cfg["min_size"], heartbeat_timeout=cfg["heartbeat_timeout"],
                       timeout=cfg["timeout"], join_timeout=cfg["join_timeout"],
                       residuals=cfg["residuals"])
        _train(trainer, data, world, cfg, board, ledger, fired, stack)
    except QuorumError as exc:  # e.g. back after the others finished
        ledger.write("ERR", str(exc).replace("\n", " ").replace(" ", "_"))
        ledger.file.close()
        os._exit(GAVE_UP)  # the controller starts it again while the job goes on
    ledger.file.close()


def _train(trainer: Any, data: Any, world: int, cfg: dict[str, Any], board: Board,
           ledger: _Ledger, fired: Callable[[str, int], Callable[[], None]],
           stack: contextlib.ExitStack) -> None:
    from hexagram.bench.soak import global_batch

    weight = trainer.model.algorithm.kind == "weight"
    _failed_setups(ledger, trainer.stats.setdefault("failed_setups", []))
    _setup_record(ledger, trainer, weight, -1)
    while trainer.step < cfg["steps"]:
        board["step"], board["phase"] = trainer.step, TRAINING
        order, sleep = board.take(), 0.0
        if order is not None and order[0] == "slow":
            sleep = order[1]
            fired("slow", trainer.step)()
        elif order is not None and order[0] == "collective_kill":
            stack.enter_context(_kill_inside(dist, ("all_reduce", "all_gather"),
                                             trainer.replica, "after",
                                             fired("collective_kill", trainer.step)))
        x, y = global_batch(data, trainer.step, trainer.rank, trainer.size, world,
                            cfg["batch"], cfg["seed"])
        before, epoch, votes = trainer.step, trainer.epoch, trainer.stats["votes"]

        def closure(model: Any, x: Any = x, y: Any = y, sleep: float = sleep) -> None:
            if sleep:
                time.sleep(sleep)  # a straggler: alive (its heartbeat beats), slow
            F.cross_entropy(model(x), y).backward()

        failures = trainer.stats.setdefault("failed_setups", [])
        stalls, failed = len(trainer.stats["stall_s"]), len(failures)
        committed = trainer.run_step(closure)
        if len(trainer.stats["stall_s"]) > stalls:  # aborted: how long the rebuild took
            ledger.write("A", before, round(trainer.stats["stall_s"][-1], 4))
        _failed_setups(ledger, failures[failed:])
        voted = trainer.stats["votes"] > votes
        if committed:  # the step committed in `epoch` is before + 1; a membership change
            # within the step may have healed this replica further: no digest of that state
            healed_on = trainer.step != before + 1
            digest = state_digest(trainer, model=True, optimizers=not weight,
                                  residuals=False) if voted and not healed_on else "-"
            ledger.write("C", before + 1, epoch.number, int(voted and not healed_on), digest)
        if trainer.epoch is not epoch:
            _setup_record(ledger, trainer, weight, before + int(committed))
    ledger.write("END", trainer.step, state_digest(trainer, model=True, optimizers=not weight,
                                                   residuals=False))
    board["phase"] = 2.0
    trainer.close()
