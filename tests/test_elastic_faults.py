"""hexagram.testing.faults: parsing, faults at a step and inside a call, real signals."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hexagram.bench.soak import injector_for
from hexagram.errors import ConfigError
from hexagram.launch import clean_context, supervise
from hexagram.testing.faults import EXIT_CODE, Fault, FaultInjector, InjectedFault, parse_faults


def test_parse_faults() -> None:
    assert parse_faults("1@50, 2@100:sigstop,0@3:raise") == [
        Fault(1, 50, "sigkill"), Fault(2, 100, "sigstop"), Fault(0, 3, "raise")]
    assert parse_faults("") == []
    for bad in ("1", "a@3", "1@-2", "1@3:nap"):
        with pytest.raises(ConfigError, match="RANK@STEP"):
            parse_faults(bad)


def test_fault_fires_only_on_its_rank_and_step() -> None:
    FaultInjector(parse_faults("1@2:raise"), rank=0).at_step(2)  # other rank: nothing
    injector = FaultInjector(parse_faults("1@2:raise"), rank=1)
    injector.at_step(1)
    with pytest.raises(InjectedFault, match="on rank 1 at step 2"):
        injector.at_step(2)


class _Box:
    calls = 0

    @classmethod
    def work(cls) -> int:
        cls.calls += 1
        return cls.calls


def test_inside_fails_the_chosen_call_before_or_after_it_runs() -> None:
    injector = FaultInjector([], rank=0)
    _Box.calls = 0
    with injector.inside(_Box, "work", rank=0, action="raise", call=2):
        assert _Box.work() == 1
        with pytest.raises(InjectedFault, match="in work call 2"):
            _Box.work()
    assert _Box.calls == 1  # "before": the 2nd call never ran
    with injector.inside(_Box, "work", rank=0, action="raise", when="after"):
        with pytest.raises(InjectedFault, match="after work call 1"):
            _Box.work()
    assert _Box.calls == 2  # "after": it ran, then failed
    with injector.inside(_Box, "work", rank=1, action="raise"):
        assert _Box.work() == 3  # another rank's fault
    assert _Box.work() == 4  # restored


def _fail(action: str) -> None:
    FaultInjector(parse_faults(f"0@1:{action}"), 0).at_step(1)
    print("alive", flush=True)


@pytest.mark.parametrize(("action", "code"), [("exit", EXIT_CODE), ("sigkill", -9)])
def test_process_faults_are_real(action: str, code: int) -> None:
    proc = clean_context().Process(target=_fail, args=(action,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == code


def test_sigstop_freezes_the_process() -> None:
    proc = clean_context().Process(target=_fail, args=("sigstop",))
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().split(")")[1].split()[0] == "T":  # stopped, still alive
                    break
            time.sleep(0.05)
        else:
            pytest.fail("the process was never stopped")
        assert proc.is_alive()
        os.kill(proc.pid, signal.SIGCONT)
        proc.join(30)
        assert proc.exitcode == 0  # it went on after SIGCONT
    finally:
        if proc.is_alive():
            proc.kill()


_HELD = threading.Lock()


def _take_the_lock() -> None:
    if not _HELD.acquire(timeout=5):
        raise SystemExit(3)  # a copy of the parent's lock, held by a thread it has not


def test_replicas_start_clean_of_the_parents_threads() -> None:
    """What hung CI once: a replica forked while a thread of the parent (the TCPStore's
    server, resolving a peer's name) held a lock inherits it held, with no thread to
    release it, and waits forever. Replicas start from the fork server
    (``clean_context``, as ``run_live`` and ``run_soak`` start them): a lock a parent
    thread holds right then is free in the replica."""
    release, held = threading.Event(), threading.Event()

    def hold() -> None:
        with _HELD:
            held.set()
            release.wait(60)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10)
    proc = clean_context().Process(target=_take_the_lock)
    try:
        proc.start()
        proc.join(60)
    finally:
        release.set()
        thread.join(10)
    assert proc.exitcode == 0


def test_train_kill_fails_the_run_naming_the_dead_rank(tmp_path: Path) -> None:
    """``hexagram train --kill 1@3``: rank 1 is SIGKILLed at step 3; the survivors' clear
    communication error ends the run (no live mode) and the report names it."""
    from hexagram.bench import train as train_cli

    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    out = tmp_path / "train.json"
    args = parser.parse_args(["--hosts", "2", "--dataset", "digits", "--algorithms",
                              "allreduce", "--epochs", "1", "--params", "20000", "--loopback",
                              "--kill", "1@3", "--timeout", "240", "--json", str(out)])
    assert train_cli.run(args) == 1
    (row,) = json.loads(out.read_text())["results"]
    assert "error" in row and "rank" in row["error"], row
    with pytest.raises(SystemExit):  # checked as it is parsed: one line, exit 2
        parser.parse_args(["--loopback", "--kill", "one@3"])


def _dies_until(incarnation: int, survives_from: int) -> None:
    if incarnation < survives_from:
        os.kill(os.getpid(), signal.SIGKILL)


def test_supervise_restarts_a_replica_as_often_as_it_is_killed() -> None:
    """A rank killed twice is started twice more (incarnations 1 and 2); a replica that
    finishes normally is never restarted."""
    ctx = clean_context()
    started: list[tuple[int, int]] = []

    def start(rank: int, incarnation: int) -> Any:
        started.append((rank, incarnation))
        return ctx.Process(target=_dies_until, args=(incarnation, 2 if rank == 0 else 0))

    procs = {r: start(r, 0) for r in (0, 1)}
    for proc in procs.values():
        proc.start()
    assert supervise(procs, start, {0: 2, 1: 2}, 0.0, time.monotonic() + 60)
    for proc in procs.values():
        proc.join(10)
    assert started == [(0, 0), (1, 0), (0, 1), (0, 2)]
    assert procs[0].exitcode == 0 and procs[1].exitcode == 0


def test_a_restarted_replica_gets_only_its_later_faults() -> None:
    kill = "1@50,2@20,1@10"
    assert sorted(injector_for(kill, 1, 0).faults) == [10, 50]
    assert sorted(injector_for(kill, 1, 1).faults) == [50]  # it may rejoin at step 10
    assert not injector_for(kill, 1, 2).faults and not injector_for(kill, 0, 0).faults
