"""The one way Hexagram starts processes: ranks of a job, replicas that may be restarted.

- :func:`run_local`: a function on N local ranks with torch.distributed's variables set
  (the demo, the tests, the benchmarks);
- :func:`start_ranks` / :func:`wait_ranks`: a command once per rank, each with its own
  environment and log, optionally inside a wrapper such as ``ip netns exec HOST`` (the
  loopback and namespace labs of ``hexagram bench``);
- :func:`supervise`: replicas that are restarted when they die or freeze (live elastic
  mode's soak and fault tests);
- :func:`clean_context`: processes that start clean of the parent's threads.

Every run has a deadline: ranks still alive then are killed and reported, so nothing hangs.

Example:
    >>> def work(scale: float) -> float:
    ...     import hexagram as hx
    ...     rt = hx.init()
    ...     return rt.rank * scale
    >>> run_local(work, world_size=2, args=(2.0,))   # doctest: +SKIP
    [0.0, 2.0]
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import pickle
import pkgutil
import queue
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hexagram.errors import HexagramError

__all__ = ["LaunchError", "clean_context", "die_with_parent", "free_port", "frozen",
           "preloaded_modules", "run_local", "start_ranks", "supervise", "wait_ranks"]


class LaunchError(HexagramError):
    """One or more ranks failed or missed the deadline (the message holds their errors)."""

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors


def clean_context() -> Any:
    """A multiprocessing context whose processes start clean: forkserver, or spawn where
    the platform has no fork server.

    Never ``fork`` from a process that may have threads (a test runner after other tests,
    a process hosting a ``TCPStore``, whose server thread resolves peer names): a lock a
    thread held at the fork stays locked in the child forever. A replica restarted while
    the store's thread held glibc's resolver lock hung in ``getnameinfo`` inside its own
    ``TCPStore`` constructor (seen in CI). The fork server is a fresh,
    single-threaded process: it imports torch, hexagram's engine, the live trainer and
    every registered algorithm once (:func:`preloaded_modules`), and each child is forked
    from it ready to run, without spawn's ~3 CPU-seconds of imports. The semantics are
    spawn's: the target and its arguments are pickled, ``__main__`` is re-imported.

    Example:
        >>> clean_context().get_start_method() in ("forkserver", "spawn")
        True
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preloaded_modules())
    return ctx


def preloaded_modules() -> list[str]:
    """What the fork server imports once: the engine, the live trainer, every registered
    algorithm (the registry imports an algorithm's module lazily, on first use) and
    ``torch._dynamo``, which the engine no longer imports but ``torch.compile`` and the
    integrations' frameworks (transformers, lightning, accelerate) do, about 2 CPU-s per
    rank otherwise. Named from the files, not the registry: the launcher stands below the
    algorithms."""
    package = Path(__file__).resolve().parent
    algorithms = [f"hexagram.algorithms.{m.name}" for m in pkgutil.iter_modules(
        [str(package / "algorithms")])] + ["hexagram.auto.algorithm"]
    return ["torch", "torch.distributed", "torch._dynamo", "hexagram", "hexagram.engine.ddp",
            "hexagram.elastic.trainer", *sorted(algorithms)]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, env: dict[str, str], args: Sequence[Any],
           results: Any, threads: int) -> None:
    # The caller's whole environment, as spawn would give: a forked rank starts from the
    # fork server's, which is the caller's at the first run_local.
    os.environ.clear()
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    import torch

    torch.set_num_threads(threads)
    try:
        # Plain pickle bytes, not the queue's own pickler: torch would share tensors through
        # file descriptors that vanish when this process exits before the parent reads them.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        from hexagram import runtime

        if runtime.is_initialized():
            try:
                runtime.shutdown()
            except Exception:  # peers may be gone already
                pass


def _environment(world_size: int, port: int, threads: int,
                 env: Mapping[str, str] | None) -> dict[str, str]:
    base = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GROUP_RANK": "0",
            "OMP_NUM_THREADS": str(threads)}
    base.update(env or {})
    return {**os.environ, **base}


def run_local(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
              timeout: float = 120.0, env: Mapping[str, str] | None = None,
              threads: int = 1, allow_failures: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks; return each rank's result.

    Args:
        fn: a picklable (module-level) function; it calls ``hexagram.init()`` itself.
        world_size: number of ranks.
        timeout: seconds for the whole run; ranks alive then are killed.
        env: extra environment variables for every rank.
        threads: torch/OpenMP threads per rank (1 keeps ranks from fighting over cores).
        allow_failures: return the traceback text of failed ranks instead of raising.
    """
    ctx = clean_context()
    results = ctx.Queue()
    full_env = _environment(world_size, free_port(), threads, env)
    procs = [ctx.Process(target=_entry, args=(fn, r, full_env, args, results, threads),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(out) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
            out[rank] = (ok, pickle.loads(value) if ok else value)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join()
    errors = {r: v for r, (ok, v) in out.items() if not ok}
    for r, p in enumerate(procs):
        if r not in out:
            errors[r] = f"rank {r} produced no result (exit code {p.exitcode}; killed after " \
                        f"the {timeout:.0f}s deadline if still running)"
    if errors and not allow_failures:
        detail = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        raise LaunchError(f"{len(errors)} of {world_size} ranks failed:\n{detail}", errors)
    return [out[r][1] if r in out else errors[r] for r in range(world_size)]


def die_with_parent() -> None:
    """``preexec_fn`` for rank processes: the kernel SIGKILLs the child when its parent
    dies (``PR_SET_PDEATHSIG``), so ranks never outlive a killed harness."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_ranks(argv: Sequence[str], envs: Sequence[Mapping[str, str]], logdir: Path,
                prefix: Callable[[int], Sequence[str]] | None = None,
                ) -> list[subprocess.Popen[bytes]]:
    """Start ``argv`` once per rank with ``envs[rank]`` (the whole environment), output in
    ``logdir / f"rank{rank}.log"``; ``prefix(rank)`` (e.g. ``["ip", "netns", "exec", ns]``)
    runs it inside a host. Each rank leads its own session and dies with this process.

    Example:
        >>> import sys, tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     procs = start_ranks([sys.executable, "-c", "pass"], [{}, {}], Path(d))
        ...     wait_ranks(procs, timeout=30)
        [0, 0]
    """
    procs = []
    for rank, env in enumerate(envs):
        with open(logdir / f"rank{rank}.log", "wb") as log:  # the child keeps its copy
            procs.append(subprocess.Popen([*(prefix(rank) if prefix else ()), *argv],
                                          env=dict(env), stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=die_with_parent))
    return procs


def wait_ranks(procs: Sequence[subprocess.Popen[bytes]], timeout: float = 600.0,
               grace: float = 15.0) -> list[int | None]:
    """Wait until every rank exits; kill them all at ``timeout`` seconds, or ``grace``
    seconds after the first failure (its peers would otherwise wait for it). Returns each
    rank's exit code, ``None`` for one killed here or by a signal."""
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + grace)
            time.sleep(0.05)
    finally:  # also on Ctrl-C
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode if p.returncode is not None and p.returncode >= 0 else None
            for p in procs]


def frozen(proc: Any) -> bool:
    """True when ``proc`` is stopped (SIGSTOP: alive, silent, its sockets open)."""
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def supervise(procs: dict[int, Any], start: Callable[[int, int], Any],
               restart: Mapping[int, int] | set[int], restart_delay: float,
               deadline: float) -> bool:
    """Wait for the replicas until ``deadline``; start a replica of ``restart`` again
    ``restart_delay`` s after it died or froze (a frozen one is SIGKILLed first), at most
    ``restart[r]`` times (a set: once each); ``start(rank, incarnation)`` builds the new
    process, ``incarnation`` counting from 1. A frozen replica that is not restarted stays
    frozen until every other replica has ended. Returns False when the deadline came
    first.

    Works on any process object with ``pid``, ``exitcode``, ``is_alive()``, ``kill()``,
    ``join()`` and ``start()`` (multiprocessing's, or a wrapper around a command).
    """
    left = dict.fromkeys(restart, 1) if isinstance(restart, set) else dict(restart)
    incarnation: dict[int, int] = {}
    failed: dict[int, float] = {}
    def down(r: int) -> bool:  # killed or frozen with a restart left (0: it finished)
        return left.get(r, 0) > 0 and (procs[r].exitcode not in (None, 0) or frozen(procs[r]))

    while (any(p.is_alive() and not frozen(p) for p in procs.values())
           or any(down(r) for r in procs)) and time.monotonic() < deadline:
        for r in filter(down, list(procs)):
            failed.setdefault(r, time.monotonic())
            if time.monotonic() > failed[r] + restart_delay:
                procs[r].kill()
                procs[r].join()
                incarnation[r] = incarnation.get(r, 0) + 1
                procs[r] = start(r, incarnation[r])
                procs[r].start()
                left[r] -= 1
                failed.pop(r)
        time.sleep(0.05)
    return time.monotonic() < deadline
