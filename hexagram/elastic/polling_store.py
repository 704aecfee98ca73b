"""A store whose waits poll: the rendezvous of live mode's process groups.

Every membership of live mode builds new gloo process groups (the epoch's default group,
the wrapper's, an algorithm's own), and each one meets its peers in the job's
``TCPStore``: gloo publishes its address under a key and blocks in ``get`` (a server-side
wait) for every peer's. In the chaos soak (1,000 failures per run, 2026-11-28) a handful
of memberships spent 6.6-10.5 s in that phase with every member alive and present,
against 20-60 ms otherwise; every replica's stack, dumped during the stall, was inside
``ProcessGroupGloo``'s construction, and each time a process had just been thawed from a
SIGSTOP. The commit vote and the watcher had met the same kind of wait earlier: a key set
while a blocking ``TCPStore`` wait was being served left the waiter blocked for seconds
(:meth:`hexagram.elastic.quorum.Quorum.wait_key` polls ``check()`` since). This store
does the same for every wait and ``get`` of a group's rendezvous: ``check()`` (1 ms,
doubling to 10 ms) until the keys exist, then the plain read; sets, adds and
compare-and-sets go straight through.

Example:
    >>> store = PollingStore(dist.PrefixStore("e7/pg/", job_store), timeout=30.0)
    ... # doctest: +SKIP
    >>> dist.init_process_group("gloo", store=store, rank=0, world_size=3)  # doctest: +SKIP
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["PollingStore", "poll_keys"]

_FIRST_PAUSE, _LONGEST_PAUSE = 0.001, 0.01


def poll_keys(store: dist.Store, keys: list[str], timeout: float) -> bool:
    """True once every key of ``keys`` exists in ``store``, False after ``timeout`` s:
    ``check()`` at 1 ms, the pause doubling up to 10 ms (never a blocking store wait)."""
    end, pause = time.monotonic() + timeout, _FIRST_PAUSE
    while not store.check(keys):
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, _LONGEST_PAUSE)
    return True


class PollingStore(dist.Store):
    """``inner`` with every wait (``wait``, ``get``) polling ``check()``; ``timeout`` (s)
    bounds a wait that is given none, as the inner store's own timeout would.

    Raises:
        DistStoreError: a wait outlived its timeout (the keys are named).
    """

    def __init__(self, inner: dist.Store, timeout: float) -> None:
        super().__init__()
        self.inner, self._timeout = inner, timedelta(seconds=timeout)

    def _poll(self, keys: list[str], timeout: timedelta | None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        if not poll_keys(self.inner, keys, limit):
            raise dist.DistStoreError(f"wait timeout after {limit:.1f} s, keys: {keys}")

    def get(self, key: str) -> bytes:
        self._poll([key], None)
        return self.inner.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._poll(keys, timeout)

    def set(self, key: str, value: str | bytes) -> None:
        # gloo sets binary addresses (bytes); the binding takes both, its stub says str
        self.inner.set(key, value)  # type: ignore[arg-type]

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def clone(self) -> PollingStore:
        """A store of its own connection (``new_group`` gives each group one)."""
        inner = self.inner.clone()  # type: ignore[attr-defined]  # bound, not in the stub
        return PollingStore(inner, self._timeout.total_seconds())

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._poll(keys, None)
        return self.inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self.inner.multi_set(keys, values)  # type: ignore[attr-defined]  # not in the stub

    def append(self, key: str, value: str) -> None:
        self.inner.append(key, value)  # type: ignore[attr-defined]  # not in the stub

    def has_extended_api(self) -> bool:
        return bool(self.inner.has_extended_api())  # type: ignore[attr-defined]  # no stub
