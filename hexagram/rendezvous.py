"""Process-group set-up that survives ``torchrun --max-restarts``: a store per attempt, a deadline.

torchrun's agent keeps one TCP store for the whole job. Workers of a restarted attempt that
reuse its keys read the *previous* attempt's gloo addresses and hang in ``connectFullMesh``
(static rendezvous) or fail with "Connection refused" (c10d rendezvous). Hexagram gives every
attempt its own key space, ``hexagram/<run id>/attempt_<TORCHELASTIC_RESTART_COUNT>/<n>/``
(``n`` counts ``hexagram.init`` calls in this process), and bounds the whole set-up by the
init timeout: every rank first announces itself on the store, and set-up that cannot
complete raises :class:`InitTimeoutError` naming the ranks that never arrived.

Example:
    >>> from datetime import timedelta
    >>> store = attempt_store(rank=0, world_size=1, timeout=timedelta(seconds=5),
    ...                       generation=0)   # doctest: +SKIP
    >>> wait_for_all(store, rank=0, world_size=1, timeout=timedelta(seconds=5))  # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from hexagram.errors import CommTimeoutError, ConfigError

__all__ = ["InitTimeoutError", "attempt_prefix", "attempt_store", "call_with_deadline",
           "wait_for_all"]

T = TypeVar("T")


class InitTimeoutError(CommTimeoutError):
    """Process-group set-up did not complete within the init timeout (names missing ranks)."""


def attempt_prefix(generation: int = 0) -> str:
    """Key prefix of this restart attempt: run id, torchrun's restart count, init count."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"hexagram/{run_id}/attempt_{attempt}/{generation}/"


def attempt_store(rank: int, world_size: int, timeout: timedelta,
                  generation: int = 0) -> dist.Store:
    """A store for this attempt's process group (keys of earlier attempts are invisible).

    Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) every rank is a client of the
    agent's store at ``MASTER_ADDR:MASTER_PORT``; otherwise rank 0 hosts it, as
    ``init_process_group("env://")`` does.
    """
    addr = os.environ.get("MASTER_ADDR")
    port_text = os.environ.get("MASTER_PORT")
    if not addr or not port_text:
        raise ConfigError("MASTER_ADDR and MASTER_PORT must be set for a multi-rank job "
                          "(torchrun sets them; or launch with hexagram.launch.run_local)")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"MASTER_PORT={port_text!r} must be an integer") from None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=(rank == 0 and not agent),
                              timeout=timeout, multi_tenant=not agent,
                              wait_for_workers=False)  # wait_for_all names who is missing
    except (RuntimeError, TimeoutError) as exc:
        raise InitTimeoutError(
            f"rank {rank} could not reach the rendezvous store at {addr}:{port} within "
            f"{timeout.total_seconds():.0f} s ({exc}); check MASTER_ADDR/MASTER_PORT and that "
            "rank 0 (or torchrun's agent) is running") from exc
    return dist.PrefixStore(attempt_prefix(generation), store)


def wait_for_all(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
    """Announce this rank and wait until every rank did, or raise naming the missing ones."""
    store.set(f"arrived/{rank}", "1")
    keys = [f"arrived/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timeout)
    except (RuntimeError, TimeoutError) as exc:  # DistStoreError is a RuntimeError
        missing = [r for r in range(world_size) if not store.check([f"arrived/{r}"])]
        raise InitTimeoutError(
            f"process-group set-up: rank(s) {missing} of {world_size} did not arrive within "
            f"{timeout.total_seconds():.0f} s (attempt "
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}); they crashed or were never "
            "started. Check their logs; torchrun --max-restarts restarts the attempt") from exc


def call_with_deadline(fn: Callable[[], T], timeout: timedelta, what: str) -> T:
    """Run ``fn`` in a helper thread; raise :class:`InitTimeoutError` if it overruns.

    A C++ call stuck in a socket connect cannot be interrupted; the daemon thread is left
    behind and the caller gets a clear error (and can exit) instead of hanging.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name=f"hexagram-{what}", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds())
    if thread.is_alive():
        raise InitTimeoutError(f"{what} did not complete within {timeout.total_seconds():.0f} s "
                               "(a peer died during set-up or the network drops connections)")
    if error:
        raise error[0]
    return result[0]
