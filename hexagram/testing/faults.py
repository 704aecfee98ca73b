"""Fault injection for tests and benchmarks: fail a rank at a step or inside a call.

Faults are real: the process exits (``exit``), is killed (``sigkill``), is frozen by the
kernel (``sigstop``: alive, silent, its sockets open) or raises :class:`InjectedFault`
(``raise``). A :class:`FaultInjector` holds this rank's faults; call :meth:`at_step` once per
training step, or wrap any function (a collective, ``dcp.save``...) with :meth:`inside`.

Example:
    >>> faults = parse_faults("1@50,2@100:sigstop")
    >>> faults[1]
    Fault(rank=2, step=100, action='sigstop')
    >>> injector = FaultInjector(faults, rank=0)
    >>> injector.at_step(50)          # rank 0 has no fault: returns
    >>> import torch.distributed as dist
    >>> with injector.inside(dist, "all_reduce", rank=0, action="raise", call=3):
    ...     pass                       # the 3rd all_reduce on rank 0 would raise here
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from hexagram.errors import ConfigError

__all__ = ["ACTIONS", "CHAOS_KINDS", "CHAOS_MIX", "EXIT_CODE", "Chaos", "Fault", "FaultInjector",
           "InjectedFault", "chaos_schedule", "parse_faults", "trigger"]

Action = Literal["exit", "sigkill", "sigstop", "raise"]
ACTIONS: tuple[str, ...] = ("exit", "sigkill", "sigstop", "raise")
#: Exit status of an injected ``exit`` (distinguishes it from real crashes in logs).
EXIT_CODE = 43


class InjectedFault(RuntimeError):
    """Raised by an injected ``raise`` fault."""


@dataclass(frozen=True)
class Fault:
    """Fail ``rank`` at training step ``step`` with ``action`` (see the module doc)."""

    rank: int
    step: int
    action: Action = "sigkill"


def parse_faults(spec: str) -> list[Fault]:
    """Parse ``"RANK@STEP[:ACTION][,...]"`` (action defaults to ``sigkill``).

    Raises:
        ConfigError: a malformed item, naming it and the expected form.
    """
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, _, action = item.partition(":")
        rank_text, at, step_text = where.partition("@")
        action = action or "sigkill"
        try:
            rank, step = int(rank_text), int(step_text)
        except ValueError:
            rank = step = -1
        if not at or rank < 0 or step < 0 or action not in ACTIONS:
            raise ConfigError(f"fault {item!r} must look like RANK@STEP or RANK@STEP:ACTION "
                              f"with RANK, STEP >= 0 and ACTION one of {', '.join(ACTIONS)}")
        faults.append(Fault(rank, step, action))  # type: ignore[arg-type]
    return faults


def trigger(action: Action, where: str = "") -> None:
    """Make this process fail now, the way ``action`` says."""
    if action == "raise":
        raise InjectedFault(f"injected fault {where}".strip())
    if action == "exit":
        os._exit(EXIT_CODE)
    sig = signal.SIGKILL if action == "sigkill" else signal.SIGSTOP
    os.kill(os.getpid(), sig)


def _fire(on_fire: Callable[[], None] | None, action: Action, where: str) -> None:
    if on_fire is not None:
        on_fire()
    trigger(action, where)


class FaultInjector:
    """This rank's faults; :meth:`at_step` fires those due at a step."""

    def __init__(self, faults: list[Fault], rank: int) -> None:
        self.rank = rank
        self.faults = {f.step: f for f in faults if f.rank == rank}

    def at_step(self, step: int) -> None:
        """Fire the fault of this rank at ``step``, if any (call once per step)."""
        fault = self.faults.get(step)
        if fault is not None:
            trigger(fault.action, f"on rank {self.rank} at step {step}")

    @contextlib.contextmanager
    def inside(self, owner: Any, name: str, *, rank: int, action: Action = "sigkill",
               call: int = 1, when: Literal["before", "after"] = "before",
               on_fire: Callable[[], None] | None = None) -> Iterator[None]:
        """Within the block, ``owner.name``'s ``call``-th call on ``rank`` fails.

        ``when="before"`` fails on entry (the call never happens); ``"after"`` lets the call
        complete first (e.g. a rank wrote its checkpoint shard, then dies before the commit).
        ``on_fire`` runs just before the failure (a soak records what fired: a SIGKILL
        leaves no other trace). Other ranks run the real function unchanged.
        """
        original: Callable[..., Any] = getattr(owner, name)
        count = 0

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            nonlocal count
            count += 1
            due = self.rank == rank and count == call
            if due and when == "before":
                _fire(on_fire, action, f"in {name} call {call} on rank {rank}")
            result = original(*args, **kwargs)
            if due:
                _fire(on_fire, action, f"after {name} call {call} on rank {rank}")
            return result

        setattr(owner, name, wrapped)
        try:
            yield
        finally:
            setattr(owner, name, original)


#: What a generated schedule draws from (:func:`chaos_schedule`): ``sigkill`` (the process
#: is killed from outside), ``sigstop`` (frozen past the heartbeat timeout, then SIGCONT),
#: ``slow`` (the rank sleeps inside one step), ``heal_kill`` (killed, and its restart is
#: killed again while it heals from a peer), ``collective_kill`` (SIGKILLed right after
#: issuing a collective of its next communicating step).
CHAOS_KINDS: tuple[str, ...] = ("sigkill", "sigstop", "slow", "heal_kill", "collective_kill")
#: Default proportions of the kinds (as :data:`CHAOS_KINDS`).
CHAOS_MIX: tuple[float, ...] = (0.3, 0.2, 0.2, 0.15, 0.15)


@dataclass(frozen=True)
class Chaos:
    """One scheduled failure: due once the job has committed ``step`` steps; ``pick`` in
    [0, 1) chooses the victim among the replicas eligible then (sorted ids: index
    ``int(pick * n)``), so the schedule is fixed before the run and the victim is still
    one that is training."""

    index: int
    step: int
    kind: str
    pick: float

    @property
    def faults(self) -> int:
        """Failures it injects: a ``heal_kill`` is two (the kill, then the one in healing)."""
        return 2 if self.kind == "heal_kill" else 1


def chaos_schedule(failures: int, every: int, seed: int = 0, first: int | None = None,
                   mix: tuple[float, ...] = CHAOS_MIX) -> list[Chaos]:
    """A seeded schedule of at least ``failures`` failures, one event every ``every``
    committed steps from step ``first`` (default ``every``), kinds drawn with the
    proportions ``mix`` (over :data:`CHAOS_KINDS`). Same arguments, same schedule.

    Raises:
        ConfigError: ``every`` < 1, ``failures`` < 0, or a ``mix`` that is not one
            non-negative weight per kind with a positive sum.

    Example:
        >>> s = chaos_schedule(5, every=20, seed=1)
        >>> [c.step for c in s][:3], sum(c.faults for c in s) >= 5
        ([20, 40, 60], True)
        >>> s == chaos_schedule(5, every=20, seed=1)
        True
    """
    import random

    if every < 1 or failures < 0:
        raise ConfigError(f"chaos_schedule needs every >= 1 and failures >= 0, got every="
                          f"{every}, failures={failures}")
    if len(mix) != len(CHAOS_KINDS) or min(mix) < 0 or sum(mix) <= 0:
        raise ConfigError(f"mix must give one weight >= 0 per kind {CHAOS_KINDS} with a "
                          f"positive sum, got {mix}")
    rng = random.Random(seed)
    start = every if first is None else first
    out: list[Chaos] = []
    while sum(c.faults for c in out) < failures:
        kind = rng.choices(CHAOS_KINDS, weights=mix)[0]
        out.append(Chaos(len(out), start + every * len(out), kind, rng.random()))
    return out
