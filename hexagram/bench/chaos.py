"""The chaos soak: live mode through hundreds of generated failures of five kinds in one run.

:func:`run_chaos` hosts the job's store, starts ``world`` replicas
(:mod:`hexagram.bench.chaos_replica`) from the preloaded fork server and plays a seeded
schedule (:func:`hexagram.testing.faults.chaos_schedule`): an event every ``every``
committed steps, of a kind drawn in fixed proportions, on a replica drawn among those
training then, and only while at least ``min_size`` others train (a failure that would go
below waits for a restart to come back). The kinds:

- ``sigkill``: SIGKILL from outside; the replica is started again ``restart_delay`` s later;
- ``sigstop``: SIGSTOP for ``freeze_s`` (past the heartbeat timeout: it must be excluded),
  then SIGCONT: it finds its membership fenced and rejoins, healed;
- ``slow``: the replica sleeps ``slow_s`` inside one step (alive: it must *not* be excluded);
- ``heal_kill``: SIGKILL, and the restart is SIGKILLed again as it enters the healing
  broadcast (two failures); its next restart heals;
- ``collective_kill``: SIGKILLed right after issuing a collective of its next
  communicating step (PowerSGD: every step; a weight algorithm: the next round).

The replicas' ledgers are then read by :func:`hexagram.bench.chaos_ledger.analyse`: failures
by kind, committed steps lost, digests compared at every commit and every set-up,
goodput, the longest stall and (weight algorithms) the outer steps a healed replica takes
to contribute again.

Example:
    >>> report = run_chaos(algorithm="powersgd", failures=10, every=30)  # doctest: +SKIP
    >>> report["steps_lost"], report["commit_mismatches"]                # doctest: +SKIP
    (0, 0)
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hexagram.bench.chaos_ledger import analyse
from hexagram.bench.chaos_replica import FIELDS, GAVE_UP, TRAINING, Board, replica_main
from hexagram.launch import clean_context, free_port
from hexagram.testing.faults import CHAOS_KINDS, CHAOS_MIX, Chaos, chaos_schedule

__all__ = ["ChaosConfig", "run_chaos"]


@dataclass(kw_only=True)
class ChaosConfig:
    """Settings of one chaos run (see the module doc); ``steps`` defaults to the schedule
    plus ``tail`` steps after its last event."""

    world: int = 4
    algorithm: str = "powersgd"
    config: dict[str, Any] = field(default_factory=dict)
    failures: int = 10
    every: int = 30
    seed: int = 0
    mix: tuple[float, ...] = CHAOS_MIX
    tail: int = 200
    steps: int = 0
    dataset: str = "digits"
    batch: int = 32
    lr: float = 0.05
    min_size: int = 2
    heartbeat_timeout: float = 0.25
    restart_delay: float = 0.1
    freeze_s: float = 1.0
    slow_s: float = 0.5
    timeout: float = 30.0
    join_timeout: float = 20.0
    residuals: str = "reset"
    deadline: float = 3600.0
    keep: str | None = None  # a folder for the raw ledgers, events and stacks
    stall_dump: float = 5.0  # a stall this long: every replica's stacks (see keep)


class _Replica:
    """The controller's view of one replica id across its incarnations."""

    def __init__(self) -> None:
        self.proc: Any = None
        self.incarnation = -1
        self.expect_death = False  # SIGKILLed by us, or armed to die inside
        self.frozen_until: float | None = None
        self.restart_at: float | None = None
        self.heal_kill_next = False
        self.busy = False  # an order given that ends in its death


class _Controller:
    def __init__(self, cfg: ChaosConfig, port: int, out: str, data: Any) -> None:
        self.cfg, self.port, self.out, self.data = cfg, port, out, data
        self.ctx = clean_context()
        self.array = self.ctx.Array("d", cfg.world * len(FIELDS), lock=False)
        self.replicas = [_Replica() for _ in range(cfg.world)]
        self.events: list[dict[str, Any]] = []
        self.crashes: list[str] = []
        self.top = -1
        self.done = False
        self.stall_top, self.stall_since, self.dumped = -1, time.monotonic(), False

    def note(self, event: str, r: int, **extra: Any) -> None:
        self.events.append({"t": time.time(), "event": event, "replica": r,
                            "incarnation": self.replicas[r].incarnation if r >= 0 else -1,
                            "step": self.top,
                            **extra})

    def start(self, r: int) -> None:
        rep, board = self.replicas[r], Board(self.array, r)
        rep.incarnation += 1
        for name in FIELDS:
            board[name] = -1.0 if name == "step" else 0.0
        rep.proc = self.ctx.Process(target=replica_main, args=(
            r, self.cfg.world, self.port, self._cfg(), rep.incarnation, self.out, self.data,
            self.array, rep.heal_kill_next))
        self.note("start", r, heal_kill=rep.heal_kill_next)
        rep.heal_kill_next = rep.expect_death = rep.busy = False
        rep.restart_at = None
        rep.proc.start()

    def _cfg(self) -> dict[str, Any]:
        return {k: getattr(self.cfg, k) for k in (
            "steps", "algorithm", "config", "batch", "lr", "min_size", "heartbeat_timeout",
            "timeout", "join_timeout", "seed", "residuals")}

    def tend(self, r: int, now: float) -> None:
        """Reap a dead incarnation (restart it unless the job is ending), thaw a frozen one."""
        rep, board = self.replicas[r], Board(self.array, r)
        if rep.proc is not None and rep.proc.exitcode is not None:
            code, fired = rep.proc.exitcode, board["fired"] > 0
            self.note("exit", r, code=code)
            if code not in (0, GAVE_UP) and not (rep.expect_death or fired):
                self.crashes.append(f"replica {r} incarnation {rep.incarnation} exited "
                                    f"with {code} without an injected fault")
            rep.proc, rep.frozen_until = None, None
            if code != 0 and not self.done:
                rep.restart_at = now + self.cfg.restart_delay
        if rep.frozen_until is not None and now >= rep.frozen_until and rep.proc is not None:
            os.kill(rep.proc.pid, signal.SIGCONT)
            rep.frozen_until = None
            self.note("sigcont", r)
        if rep.proc is None and rep.restart_at is not None and now >= rep.restart_at \
                and not self.done:
            self.start(r)

    def eligible(self) -> list[int]:
        """Replicas training at the newest step, alive, not frozen, with no order pending."""
        out = []
        for r, rep in enumerate(self.replicas):
            board = Board(self.array, r)
            if rep.proc is not None and rep.frozen_until is None and not rep.busy \
                    and board["phase"] == TRAINING and board["step"] >= self.top - 1 \
                    and board["order"] <= board["taken"]:
                out.append(r)
        return out

    def inject(self, chaos: Chaos, now: float) -> bool:
        """Fire ``chaos`` if enough replicas train to keep ``min_size`` (else: not yet)."""
        ready = self.eligible()
        if len(ready) < (1 if chaos.kind == "slow" else self.cfg.min_size + 1):
            return False
        r = ready[int(chaos.pick * len(ready))]
        rep, board = self.replicas[r], Board(self.array, r)
        if chaos.kind in ("sigkill", "heal_kill"):
            rep.expect_death, rep.heal_kill_next = True, chaos.kind == "heal_kill"
            os.kill(rep.proc.pid, signal.SIGKILL)
        elif chaos.kind == "sigstop":
            os.kill(rep.proc.pid, signal.SIGSTOP)
            rep.frozen_until = now + self.cfg.freeze_s
        else:  # an order the replica carries out itself
            rep.busy = chaos.kind == "collective_kill"
            board["kind"] = CHAOS_KINDS.index(chaos.kind)
            board["arg"] = self.cfg.slow_s
            board["order"] = board["order"] + 1
        self.note(chaos.kind, r, index=chaos.index, due=chaos.step)
        return True

    def run(self, schedule: list[Chaos], deadline: float) -> bool:
        """Play ``schedule`` until every replica ended; False past ``deadline``."""
        for r in range(self.cfg.world):
            self.start(r)
        i = 0
        while time.monotonic() < deadline:
            now = time.monotonic()
            self.top = max([self.top] + [int(Board(self.array, r)["step"])
                                         for r in range(self.cfg.world)])
            self.done = self.done or any(Board(self.array, r)["phase"] == 2.0
                                         for r in range(self.cfg.world))
            for r in range(self.cfg.world):
                self.tend(r, now)
            if i < len(schedule) and self.top >= schedule[i].step and not self.done \
                    and self.inject(schedule[i], now):
                i += 1
            self.dump_if_stalled(now)
            if all(rep.proc is None and (rep.restart_at is None or self.done)
                   for rep in self.replicas):
                return True
            time.sleep(0.005)
        return False

    def dump_if_stalled(self, now: float) -> None:
        """Once per stall of ``stall_dump`` s (the newest step not moving), have every
        running replica write its threads' stacks (SIGUSR1: faulthandler) next to its
        ledger: where a stall is spent, seen from every side."""
        if self.top != self.stall_top:
            self.stall_top, self.stall_since, self.dumped = self.top, now, False
        elif not self.dumped and now - self.stall_since > self.cfg.stall_dump \
                and not self.done and self.top >= 1:
            self.dumped = True
            self.note("stacks", -1, stalled_s=round(now - self.stall_since, 3))
            for r, rep in enumerate(self.replicas):  # those whose handler is in place
                if rep.proc is not None and rep.proc.exitcode is None \
                        and rep.frozen_until is None \
                        and Board(self.array, r)["pid"] == rep.proc.pid:
                    os.kill(rep.proc.pid, signal.SIGUSR1)

    def stop(self) -> None:
        for rep in self.replicas:
            if rep.proc is not None and rep.proc.is_alive():
                os.kill(rep.proc.pid, signal.SIGCONT)
                rep.proc.kill()
                rep.proc.join(10)


def run_chaos(cfg: ChaosConfig | None = None, **overrides: Any) -> dict[str, Any]:
    """Run one chaos soak (see the module doc) and return its analysis, with the settings,
    the schedule's size and ``crashes``: a replica that died without an injected fault, or
    the run overrunning ``deadline`` (empty when the run went as planned)."""
    from hexagram.bench.soak import _data

    cfg = cfg or ChaosConfig()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    schedule = chaos_schedule(cfg.failures, cfg.every, cfg.seed, mix=cfg.mix)
    if not cfg.steps:
        last = schedule[-1].step if schedule else 0
        cfg.steps = last + cfg.tail
    _start_fork_server()  # it imports torch and hexagram while this process loads the data
    data = _data(cfg.dataset)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        ctl = _Controller(cfg, port, out, data)
        try:
            in_time = ctl.run(schedule, time.monotonic() + cfg.deadline)
        finally:
            ctl.stop()
        del store
        ledgers = {f.stem[6:]: f.read_text().splitlines()
                   for f in sorted(Path(out).glob("ledger*.txt"))}
        stacks = {f.stem[6:]: f.read_text() for f in sorted(Path(out).glob("stacks*.txt"))
                  if f.stat().st_size}
    if cfg.keep:  # the raw ledgers and events, to study a run
        Path(cfg.keep).mkdir(parents=True, exist_ok=True)
        (Path(cfg.keep) / "ledgers.json").write_text(json.dumps(
            {"ledgers": ledgers, "events": ctl.events, "stacks": stacks}))
    wall = time.perf_counter() - started
    if not in_time:
        ctl.crashes.append(f"the run overran its deadline of {cfg.deadline:.0f} s")
    report = analyse(ledgers, ctl.events, cfg.steps, weight=_is_weight(cfg.algorithm))
    report.update(settings=asdict(cfg), scheduled_events=len(schedule), wall_s=wall,
                  crashes=ctl.crashes)
    return report


def _start_fork_server() -> None:
    """Start the fork server the replicas come from (:func:`clean_context`) now: its
    imports (seconds on a loaded machine) overlap the data set's loading here."""
    if clean_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _is_weight(algorithm: str) -> bool:
    from hexagram.algorithms import registry

    return registry.get(algorithm).kind == "weight"
