"""Liveness of live mode's replicas: heartbeats, the step watcher, set-up failures.

- :class:`Heartbeat`: a thread keeping ``hb/<replica>`` fresh on the job's store, with
  this process's token (what :meth:`hexagram.elastic.quorum.Quorum.members_alive` reads);
- :class:`Watcher`: a thread that, while a step or a set-up runs, aborts the collectives
  of a membership that failed (a peer decided ``abort``, or a member's heartbeat went
  stale), so a survivor votes instead of waiting out the collective timeout;
- :func:`peer_failure`: a peer's death inside a set-up collective as :class:`CommError`.

Example:
    >>> hb = Heartbeat("127.0.0.1", port, "job/", replica=0, interval=0.1)  # doctest: +SKIP
    >>> hb.stop()                                                             # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from hexagram.errors import CommError

if TYPE_CHECKING:
    from hexagram.elastic.quorum import Epoch, Quorum

__all__ = ["Heartbeat", "Watcher", "peer_failure"]


@contextlib.contextmanager
def peer_failure(what: str) -> Iterator[None]:
    """Collectives of a membership's set-up (healing, re-centring) outside the engine's
    communicator: a peer that dies in them makes gloo raise a bare ``RuntimeError``
    ("Connection closed by peer"); raise :class:`CommError` instead, which live mode
    answers by forming the next membership. (A replica killed while it healed took its
    source down with it before: the source's broadcast raised ``RuntimeError``.)"""
    try:
        yield
    except (CommError, dist.DistError):
        raise
    except RuntimeError as exc:
        raise CommError(f"live mode: {what} failed: a member probably died. Backend said: "
                        f"{exc}") from exc


class Heartbeat:
    """A daemon thread that writes ``hb/<replica>`` = ``"<wall clock> <token>"`` every
    ``interval`` s (``token``: this process's, :attr:`Quorum.token`: a restarted replica's
    heartbeat does not keep its dead predecessor's membership alive).

    It uses its own store client, so a busy training thread never delays it.
    """

    def __init__(self, host: str, port: int, prefix: str, replica: int,
                 interval: float, token: str = "") -> None:
        self._store = dist.PrefixStore(prefix, dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=30),
            wait_for_workers=False))
        self._key, self._interval, self._token = f"hb/{replica}", interval, token
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"hexagram-heartbeat-{replica}")
        self._thread.start()

    def beat(self) -> None:
        self._store.set(self._key, f"{time.time()!r} {self._token}".strip())

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

    def arm(self, epoch: Epoch, index: int) -> None:
        """Watch vote ``index`` of ``epoch`` (the vote the running step would take)."""
        with self._lock:
            self._armed = (epoch, index)
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
        q, key = self.quorum, f"e{epoch.number}/v{step}/decision"
        wait = max(q.heartbeat_timeout / 4, 0.02)
        while self._armed == (epoch, step):
            if not q.wait_key(key, wait):
                if not q.members_alive(epoch):
                    q.store.compare_set(key, "", "abort")
                continue
            if q.store.get(key) == b"abort" and self._armed == (epoch, step):
                try:
                    self._on_abort(epoch)
                except Exception:  # the watcher must outlive one failed abort: the
                    pass  # trainer's own collective then fails or times out
            with self._lock:
                if self._armed == (epoch, step):
                    self._armed = None
            return
