"""Run a function on N local ranks (processes) with torch.distributed's variables set.

Used by the demo, the tests and the benchmarks. Every run has a deadline: ranks still alive
then are killed and :class:`LaunchError` says which ones, so nothing hangs.

Example:
    >>> def work(scale: float) -> float:
    ...     import hexagram as hx
    ...     rt = hx.init()
    ...     return rt.rank * scale
    >>> run_local(work, world_size=2, args=(2.0,))   # doctest: +SKIP
    [0.0, 2.0]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import pkgutil
import queue
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hexagram.errors import HexagramError

__all__ = ["LaunchError", "clean_context", "free_port", "preloaded_modules", "run_local"]


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
    """What the fork server imports once: the engine, the live trainer and every registered
    algorithm (the registry imports an algorithm's module lazily, on first use). Named from
    the files, not the registry: the launcher stands below the algorithms."""
    package = Path(__file__).resolve().parent
    algorithms = [f"hexagram.algorithms.{m.name}" for m in pkgutil.iter_modules(
        [str(package / "algorithms")])] + ["hexagram.auto.algorithm"]
    return ["torch", "torch.distributed", "hexagram", "hexagram.engine.ddp",
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
