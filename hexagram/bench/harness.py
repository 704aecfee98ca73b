"""Run one worker task per algorithm on a lab (or on loopback) and collect rank results.

Example:
    >>> with NetworkLab(LabConfig(hosts=2, bandwidth="100mbit")) as lab:   # doctest: +SKIP
    ...     outcome = run_task(lab, {"task": "step", "algorithm": "ddp", ...}, timeout=300)
    >>> outcome.ok, outcome.ranks[0]["step_times"]                         # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from hexagram.bench.lab import LabConfig, NetworkLab, RankResult
from hexagram.bench.peers import PEERS
from hexagram.launch import free_port, start_ranks, wait_ranks

__all__ = ["LoopbackLab", "Outcome", "check_algorithms", "machine_info", "run_task"]

WORKER = [sys.executable, "-m", "hexagram.bench.worker"]


@dataclass
class Outcome:
    """Rank results of one task, or why it failed (missing algorithm, error, deadline)."""

    algorithm: str
    ranks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class LoopbackLab:
    """The lab's ``run`` interface on 127.0.0.1, unshaped, without root (no link counters).

    Ranks are grouped into ``hosts`` by ``HEXAGRAM_HOST`` only, so hierarchical code paths
    still run, but every byte goes over loopback.
    """

    def __init__(self, config: LabConfig) -> None:
        self.config = config
        self._tmp = tempfile.TemporaryDirectory(prefix="hexagram-loopback-")
        self.workdir = Path(self._tmp.name)
        self._old: Any = None

    def __enter__(self) -> LoopbackLab:
        # SIGTERM unwinds like Ctrl-C, so ranks are killed and temporary files removed
        self._old = signal.signal(signal.SIGTERM, _interrupt) \
            if threading.current_thread() is threading.main_thread() else None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
        self._tmp.cleanup()

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout: float = 600.0, threads: int = 1, grace: float = 15.0) -> list[RankResult]:
        world, per_host = self.config.world_size, self.config.ranks_per_host
        base = {**os.environ, **(env or {}), "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(per_host), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": str(threads)}
        base.pop("HEXAGRAM_LAB_IFNAME", None)
        envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(r % per_host),
                 "GROUP_RANK": str(r // per_host), "HEXAGRAM_HOST": f"host{r // per_host}"}
                for r in range(world)]
        codes = wait_ranks(start_ranks(argv, envs, self.workdir), timeout, grace)
        return [RankResult(r, r // per_host, code,
                           (self.workdir / f"rank{r}.log").read_text(errors="replace")[-3000:])
                for r, code in enumerate(codes)]


def check_algorithms(names: Sequence[str]) -> dict[str, str]:
    """Names that cannot run, with why (not a PyTorch peer nor a registered algorithm)."""
    from hexagram.algorithms import registry

    known = set(registry.names())
    missing = {}
    for name in names:
        if name not in PEERS and name not in known:
            missing[name] = ("not registered in hexagram.algorithms (registered: "
                             f"{', '.join(sorted(known))}; peers: {', '.join(PEERS)})")
    return missing


def _root_cause(error: str) -> str:
    # torch wraps hook errors repeatedly: keep the innermost message, first line only.
    inner = error.split("Got the following error when running the callback: ")[-1]
    return inner.splitlines()[0][:300] if inner.strip() else error[:300]


def _failure(results: list[RankResult], ranks: list[dict[str, Any]]) -> str | None:
    errors = [(not r["error"].startswith("hung"), r.get("time", 0.0), r["rank"], r["error"])
              for r in ranks if "error" in r]
    if errors:
        _, _, rank, error = min(errors)  # a hang explains the rest, else the earliest error
        return f"rank {rank}: {_root_cause(error)}"
    bad = [r for r in results if r.returncode != 0]
    if bad:
        first = bad[0]
        what = "missed the deadline" if first.returncode is None else f"exit {first.returncode}"
        tail = first.output.strip().splitlines()[-1:] or ["(no output)"]
        return f"rank {first.rank} {what}: {tail[0][:300]}"
    if len(ranks) < len(results):
        return "some ranks wrote no result"
    return None


def run_task(lab: NetworkLab | LoopbackLab, spec: Mapping[str, Any],
             timeout: float = 600.0, threads: int = 1) -> Outcome:
    """Run the worker with ``spec`` on every rank of ``lab``; collect ``rank<r>.json``."""
    name = str(spec["algorithm"])
    label = str(spec.get("label", name))
    missing = check_algorithms([name])
    if missing:
        return Outcome(label, error=missing[name])
    with tempfile.TemporaryDirectory(prefix="hexagram-task-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(dict(spec)))
        results = lab.run([*WORKER, str(spec_path), tmp], timeout=timeout, threads=threads)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    ranks.sort(key=lambda r: r["rank"])
    return Outcome(label, ranks, _failure(results, ranks))


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_info() -> dict[str, Any]:
    """Machine, CPU, load and software versions, for the JSON reports."""
    import torch

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "load_average": _load(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def run_series(lab: NetworkLab | LoopbackLab, specs: Sequence[Mapping[str, Any]],
               timeout: float = 600.0, threads: int = 1) -> list[Outcome]:
    """Like :func:`run_task` for each of ``specs`` (step benchmarks), in one launch of the
    ranks: start-up (importing torch on every rank, connecting) is paid once, which on a
    2-core machine is most of a short benchmark's time. Specs the series left without a
    result on every rank (a hang or crash stopped it) are rerun one by one."""
    labels = [str(s.get("label", s["algorithm"])) for s in specs]
    runnable = [i for i, s in enumerate(specs) if not check_algorithms([str(s["algorithm"])])]
    with tempfile.TemporaryDirectory(prefix="hexagram-series-") as tmp:
        spec = {**specs[runnable[0]], "task": "series",
                "stall_timeout": max(s.get("stall_timeout", 150.0) for s in specs),
                "runs": [dict(specs[i]) for i in runnable]} if runnable else None
        if spec is not None:
            (Path(tmp) / "spec.json").write_text(json.dumps(spec))
            lab.run([*WORKER, str(Path(tmp) / "spec.json"), tmp],
                    timeout=timeout * len(runnable), threads=threads)
        done = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.series.json"))]
    world = lab.config.world_size
    out = []
    for i, s in enumerate(specs):
        pos = runnable.index(i) if i in runnable else -1
        ranks = [r[pos] for r in done if 0 <= pos < len(r)]
        if pos >= 0 and len(ranks) == world:
            ranks.sort(key=lambda r: r["rank"])
            out.append(Outcome(labels[i], ranks, _failure([], ranks)))
        else:
            out.append(run_task(lab, s, timeout=timeout, threads=threads))
    return out
