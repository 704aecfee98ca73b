"""Live mode across machines: a long-lived store service and a per-machine replica supervisor.

Live mode (:func:`hexagram.elastic.live`) needs one c10d store that outlives every replica
(membership, heartbeats and commit votes live there) and replicas that die alone. Across
machines:

- :func:`serve` (``hexagram elastic-store --port 29400 --max-replicas 4``) hosts the store
  on one machine, as torchft's lighthouse: a ``TCPStore`` server and nothing else (it forks
  no process: a fork of a process hosting a store can inherit its thread's locks), and
  prints each new membership as it forms;
- each replica is started on its machine by :func:`supervise` (``hexagram elastic-run
  --store HOST:29400 --replica 0 -- train.py``), which restarts it when it dies, or under
  its own ``torchrun --standalone --nproc-per-node 1 --max-restarts N train.py`` with the
  same settings in the environment.

The replica finds the store through :data:`ENV_STORE` (``HOST:PORT``), its stable id
through :data:`ENV_REPLICA` (plus ``LOCAL_RANK`` when one launch starts several), the
job's key space through :data:`ENV_JOB` and the job token
(:data:`~hexagram.elastic.job_token.ENV_TOKEN`: who belongs, see
:mod:`hexagram.elastic.job_token`), and the largest membership through
:data:`ENV_MAX_REPLICAS` or, when unset, what the store service published.
Without :data:`ENV_STORE`, live mode reads ``MASTER_ADDR``/``MASTER_PORT``, ``RANK`` and
``WORLD_SIZE`` as before (one machine, one supervisor such as
:func:`hexagram.bench.live.run_live`).

Example (two machines; ``GLOO_SOCKET_IFNAME`` names the interface the replicas reach each
other on)::

    machine-a$ hexagram elastic-store --port 29400 --max-replicas 2 &
    machine-a$ hexagram elastic-run --store machine-a:29400 --replica 0 -- train.py
    machine-b$ hexagram elastic-run --store machine-a:29400 --replica 1 -- train.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from hexagram.elastic.job_token import (
    AUTH_KEY,
    ENV_TOKEN,
    auth_record,
    check_token,
    job_prefix,
    public_prefix,
    read_token,
)
from hexagram.errors import ConfigError

__all__ = ["ENV_JOB", "ENV_MAX_REPLICAS", "ENV_REPLICA", "ENV_STORE", "ENV_TOKEN",
           "LiveAddress", "live_address", "parse_address", "serve", "supervise"]

ENV_STORE = "HEXAGRAM_STORE"
ENV_REPLICA = "HEXAGRAM_REPLICA"
ENV_JOB = "HEXAGRAM_JOB"
ENV_MAX_REPLICAS = "HEXAGRAM_MAX_REPLICAS"
_CONFIG_KEY = "config"


@dataclass(frozen=True, kw_only=True)
class LiveAddress:
    """Where a replica's live mode finds its job.

    Attributes:
        host, port: the store service.
        prefix: the job's key space on it (``hexagram/live/<job>/``).
        replica: this process's stable id in ``[0, max_size)``.
        max_size: replica ids that may ever take part (the largest membership).
        job: the job's name; token: its token (never shown in a ``repr``), checked against
            the service's when the replica opens the store
            (:func:`~hexagram.elastic.job_token.check_token`).
    """

    host: str
    port: int
    prefix: str
    replica: int
    max_size: int
    job: str = "default"
    token: str | None = field(default=None, repr=False)


def parse_address(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> (host, port); a clear error otherwise.

    >>> parse_address("10.0.0.1:29400")
    ('10.0.0.1', 29400)
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"store address {text!r} must be HOST:PORT (e.g. node0:29400)")
    return host.strip("[]"), int(port)


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "")
    if value == "":
        return None
    if not value.isdigit():
        raise ConfigError(f"environment variable {name}={value!r} must be an integer >= 0")
    return int(value)


def _published_max(host: str, port: int, job: str, token: str | None,
                   timeout: float) -> int | None:
    """The ``max_replicas`` the store service published for the job, waiting up to
    ``timeout`` s for the service (a replica may start first); None: not published.
    Checks the job token first (a ConfigError when this process does not belong)."""
    root = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)
    try:
        root.wait([public_prefix(job) + AUTH_KEY], timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError):  # DistStoreError: a store without the service
        return None
    check_token(root, job, token)
    store = dist.PrefixStore(job_prefix(job, token), root)
    if not store.check([_CONFIG_KEY]):
        return None
    return int(json.loads(store.get(_CONFIG_KEY).decode())["max_replicas"])


def live_address(env: Mapping[str, str] | None = None, timeout: float = 60.0) -> LiveAddress:
    """The job a live-mode replica belongs to, from its environment (see the module doc).

    Raises:
        ConfigError: no store address, no replica id, or an id out of range.
    """
    env = os.environ if env is None else env
    if not env.get(ENV_STORE):
        addr, master_port = env.get("MASTER_ADDR"), _env_int(env, "MASTER_PORT")
        if not addr or master_port is None:
            raise ConfigError(
                "live mode needs the address of a store that outlives every replica: "
                f"{ENV_STORE}=HOST:PORT of `hexagram elastic-store` (machines of their own), "
                "or MASTER_ADDR and MASTER_PORT (one machine, e.g. torchrun's agent store)")
        return LiveAddress(host=addr, port=master_port, replica=_env_int(env, "RANK") or 0,
                           prefix=public_prefix(env.get("TORCHELASTIC_RUN_ID", "none")),
                           max_size=_env_int(env, "WORLD_SIZE") or 1)
    host, port = parse_address(env[ENV_STORE])
    first = _env_int(env, ENV_REPLICA)
    if first is None:
        raise ConfigError(f"{ENV_STORE} is set but {ENV_REPLICA} is not: give every replica "
                          "a stable id (`hexagram elastic-run --replica ID`)")
    replica = first + (_env_int(env, "LOCAL_RANK") or 0)
    job, token = env.get(ENV_JOB) or "default", read_token(env)
    size = _env_int(env, ENV_MAX_REPLICAS) or _published_max(host, port, job, token, timeout)
    if size is None:
        raise ConfigError(f"the largest membership is unknown: set {ENV_MAX_REPLICAS} or "
                          "start the store with `hexagram elastic-store --max-replicas N`")
    if replica >= size:
        raise ConfigError(f"replica id {replica} must be below the largest membership "
                          f"({size}); ids are 0..{size - 1}")
    return LiveAddress(host=host, port=port, prefix=job_prefix(job, token), replica=replica,
                       max_size=size, job=job, token=token)


def _status(store: dist.Store, max_replicas: int, seen: int) -> tuple[int, str | None]:
    """(newest epoch, a line about it if it is newer than ``seen``); a malformed record
    (a buggy or hostile client wrote it) is reported and skipped, never fatal."""
    try:
        newest = int(store.get("epoch").decode()) if store.check(["epoch"]) else 0
    except (ValueError, UnicodeDecodeError):
        newest = -1
    if newest < 0:
        return seen, "ignored a malformed epoch number in the store"
    if newest <= seen or not store.check([f"e{newest}/members"]):
        return seen, None
    try:
        record = json.loads(store.get(f"e{newest}/members").decode())
        members = ", ".join(f"{int(r)}@{int(s)}"
                            for r, s in zip(record["members"], record["steps"]))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return newest, f"ignored the malformed record of membership {newest}"
    return newest, (f"membership {newest}: replicas [{members}] (id@step) of {max_replicas}")


def serve(port: int, max_replicas: int, *, job: str = "default", host: str = "0.0.0.0",
          token: str | None = None, stop: threading.Event | None = None, poll: float = 0.5,
          log: Callable[[str], None] = print) -> None:
    """Host the live-mode store of ``job`` on ``port`` until ``stop`` is set (or SIGINT /
    SIGTERM in the main thread); log each membership as it forms.

    Args:
        port: TCP port (every interface); replicas use ``HOST:port``.
        max_replicas: the largest membership (replica ids ``0..max_replicas-1``),
            published for the replicas.
        job: key space, so several jobs can share one service (``HEXAGRAM_JOB``).
        host: the address this process's own client uses to reach the server.
        token: the job token (see :mod:`hexagram.elastic.job_token`); ``None``: any process
            that reaches the port may join (said in the first log line). Never logged.
    """
    if max_replicas < 1:
        raise ConfigError(f"max_replicas must be >= 1, got {max_replicas}")
    server = dist.TCPStore(host if host != "0.0.0.0" else "127.0.0.1", port, is_master=True,
                           wait_for_workers=False, timeout=timedelta(seconds=30))
    store = dist.PrefixStore(job_prefix(job, token), server)
    store.set(_CONFIG_KEY, json.dumps({"max_replicas": max_replicas}))
    server.set(public_prefix(job) + AUTH_KEY, auth_record(token))
    stop = stop or threading.Event()
    restore = _stop_on_signals(stop)
    guard = "job token required" if token else \
        f"no job token: any process that reaches the port can join (set {ENV_TOKEN})"
    log(f"hexagram elastic-store: job {job!r} on port {port}, up to {max_replicas} replicas; "
        f"{guard}")
    try:
        seen, last = 0, None
        while not stop.wait(poll):
            seen, line = _status(store, max_replicas, seen)
            if line and line != last:  # a malformed record is reported once, not per poll
                log(line)
            last = line or last
    finally:
        restore()
        del store, server


def _stop_on_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGINT/SIGTERM set ``stop`` (main thread only); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {sig: signal.signal(sig, lambda *_: stop.set())
           for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return restore


def _command(argv: Sequence[str]) -> list[str]:
    """A ``.py`` script runs with this interpreter (as torchrun does)."""
    if not argv:
        raise ConfigError("nothing to run: put the training command after `--`")
    return [sys.executable, "-u", *argv] if argv[0].endswith(".py") else list(argv)


def supervise(argv: Sequence[str], *, store: str, replica: int, job: str = "default",
              token: str | None = None, max_replicas: int | None = None, max_restarts: int = 3,
              restart_delay: float = 1.0, env: Mapping[str, str] | None = None,
              stop: threading.Event | None = None) -> int:
    """Run replica ``replica`` of ``job`` (``argv``: a script and its arguments) and start it
    again when it fails, at most ``max_restarts`` times; return its last exit code.

    The child gets :data:`ENV_STORE`, :data:`ENV_REPLICA`, :data:`ENV_JOB` (and
    :data:`ENV_MAX_REPLICAS` and :data:`ENV_TOKEN` when given) on top of ``env`` or this
    process's environment.
    SIGINT/SIGTERM (or ``stop``) end the child and the supervisor.
    """
    parse_address(store)
    child_env = {**(os.environ if env is None else env), ENV_STORE: store,
                 ENV_REPLICA: str(replica), ENV_JOB: job}
    if max_replicas is not None:
        child_env[ENV_MAX_REPLICAS] = str(max_replicas)
    if token:
        child_env[ENV_TOKEN] = token
    stop = stop or threading.Event()
    restore = _stop_on_signals(stop)
    try:
        for attempt in range(max_restarts + 1):
            code = _run_once(_command(argv), child_env, stop)
            if code == 0 or stop.is_set() or attempt == max_restarts:
                return code
            print(f"hexagram elastic-run: replica {replica} exited with {code}; restart "
                  f"{attempt + 1} of {max_restarts} in {restart_delay:g} s", file=sys.stderr)
            if stop.wait(restart_delay):
                return code
        return code
    finally:
        restore()


def _run_once(argv: list[str], env: Mapping[str, str], stop: threading.Event) -> int:
    proc = subprocess.Popen(argv, env=dict(env))
    while proc.poll() is None:
        if stop.wait(0.1):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return int(proc.wait())
