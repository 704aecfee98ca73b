"""The network lab: emulated hosts as Linux network namespaces on a shaped bridge.

Every host is a namespace ``<prefix><pid>h<i>`` whose ``eth0`` (address ``10.213.0.<i+1>``)
is one end of a veth pair; the other end is a port of the bridge ``br0`` inside a switch
namespace ``<prefix><pid>s``. Nothing is created in the machine's own network namespace, so
the lab cannot disturb it, and deleting the namespaces deletes every link. With a rate, both
directions of each link are shaped by ``tc qdisc ... tbf`` (host egress on ``eth0``, switch
egress on the port), like a full-duplex link of that speed. Ranks on one host share its
namespace and talk over its loopback, unshaped, as on a real machine.

Ranks start as ``ip netns exec <host> <argv>`` with torch.distributed's variables,
``GLOO_SOCKET_IFNAME=eth0`` (gloo binds to 127.0.0.1 otherwise and ranks hang) and
``HEXAGRAM_HOST`` set. Clean-up (processes, then namespaces) runs on normal exit, on errors,
on Ctrl-C and SIGTERM; ranks die with the process that started them (``PR_SET_PDEATHSIG``);
:func:`cleanup_stale` removes what a killed owner left behind.

Example:
    >>> with NetworkLab(LabConfig(hosts=2, bandwidth="100mbit")) as lab:  # doctest: +SKIP
    ...     ranks = lab.run([sys.executable, "-m", "hexagram.bench.worker", "spec.json"])
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from hexagram.config import check_int
from hexagram.errors import ConfigError, HexagramError
from hexagram.launch import start_ranks, wait_ranks

__all__ = ["LabConfig", "LabError", "LabUnavailableError", "NetworkLab", "RankResult",
           "check_available", "cleanup_stale", "parse_rate",
           "unavailable_reason"]

IFNAME = "eth0"
SUBNET = "10.213.0"
MASTER_PORT = 29500  # every lab has its own namespaces, so a fixed port cannot collide
_UNSHAPED = ("unshaped", "none", "inf", "0")
_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class LabError(HexagramError):
    """A lab command failed, or ranks failed or missed their deadline."""


class LabUnavailableError(LabError):
    """The lab cannot run here (not root, or ``ip``/``tc`` missing); the message says why."""


def parse_rate(text: str) -> float | None:
    """``"100mbit"`` -> 1e8 bits/s (tc's units, powers of ten); ``"unshaped"`` -> None."""
    value = text.strip().lower()
    if value in _UNSHAPED:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)", value)
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"bandwidth {text!r} must look like 100mbit, 1gbit, 10gbit, 500kbit "
                          "or 'unshaped'")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass(frozen=True, kw_only=True)
class LabConfig:
    """Shape of a lab.

    Attributes:
        hosts: emulated hosts (namespaces); more => more inter-host traffic per step.
        ranks_per_host: processes per host; > 1 adds fast loopback traffic inside hosts.
        bandwidth: rate of every link, e.g. ``"100mbit"`` or ``"unshaped"``; lower =>
            communication dominates.
        prefix: start of every name (letters only); tests use their own.
    """

    hosts: int = 4
    ranks_per_host: int = 1
    bandwidth: str = "unshaped"
    prefix: str = "hxl"

    def __post_init__(self) -> None:
        check_int(self, "hosts", low=1, high=250)
        check_int(self, "ranks_per_host", low=1, high=64)
        parse_rate(self.bandwidth)
        if not re.fullmatch(r"[a-z]{1,4}", self.prefix):
            raise ConfigError(f"LabConfig.prefix must be 1-4 lower-case letters, "
                              f"got {self.prefix!r}")

    @property
    def rate(self) -> float | None:
        """Link rate in bits/s, None when unshaped."""
        return parse_rate(self.bandwidth)

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host


@dataclass(frozen=True)
class RankResult:
    """How one rank ended: exit code (None if killed at the deadline) and its output tail."""

    rank: int
    host: int
    returncode: int | None
    output: str


def check_available() -> None:
    """Raise :class:`LabUnavailableError` unless we are root and ``ip`` and ``tc`` exist."""
    fix = ("run on loopback without shaping instead (e.g. `hexagram bench --loopback`, or "
           "hexagram.launch.run_local), or run as root on a Linux machine with iproute2")
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise LabUnavailableError(f"the network lab needs root (network namespaces); {fix}")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LabUnavailableError(f"the network lab needs {' and '.join(missing)} (iproute2: "
                                  f"`apt-get install iproute2`); {fix}")


def unavailable_reason() -> str | None:
    """Why the network lab cannot run here (:func:`check_available`'s message), or None.

    Example:
        >>> reason = unavailable_reason()   # e.g. for pytest.mark.skipif
    """
    try:
        check_available()
    except LabUnavailableError as exc:
        return str(exc)
    return None


def _sh(*argv: str, check: bool = True) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _sh("ip", "netns", "list", check=False).splitlines()
            if line.strip()]


def _kill_namespace(name: str) -> None:
    """Kill every process inside ``name``, then delete it (and with it, its links)."""
    for pid in _sh("ip", "netns", "pids", name, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _sh("ip", "netns", "delete", name, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = "hxl", everything: bool = False) -> list[str]:
    """Delete namespaces ``<prefix><pid>...`` whose owner is dead (all of them if
    ``everything``); return their names."""
    def stale(pid: str) -> bool:
        return everything or not _pid_alive(int(pid))

    removed = []
    for name in _namespaces():
        match = re.fullmatch(rf"{prefix}(\d+)[sh]\d*", name)
        if match and stale(match.group(1)):
            _kill_namespace(name)
            removed.append(name)
    for folder in Path(tempfile.gettempdir()).glob(f"hexagram-lab-{prefix}*"):
        match = re.match(rf"hexagram-lab-{prefix}(\d+)-", folder.name)
        if match and stale(match.group(1)):  # rank logs of a killed owner
            shutil.rmtree(folder, ignore_errors=True)
    return removed


class NetworkLab:
    """Hosts as namespaces on a shaped bridge; a context manager that always cleans up.

    Args:
        config: hosts, ranks per host, bandwidth.
        workdir: where rank logs go (a temporary folder by default).
    """

    def __init__(self, config: LabConfig, workdir: str | Path | None = None) -> None:
        check_available()
        self.config = config
        self.tag = f"{config.prefix}{os.getpid()}"
        self.switch = f"{self.tag}s"
        self.host_ns = [f"{self.tag}h{i}" for i in range(config.hosts)]
        self._tmp = None if workdir else tempfile.TemporaryDirectory(
            prefix=f"hexagram-lab-{self.tag}-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self._procs: list[subprocess.Popen[bytes]] = []
        self._old_handlers: dict[int, object] = {}
        self.started = False

    # -- set-up and clean-up -------------------------------------------------------------
    def __enter__(self) -> NetworkLab:
        self._install_signal_handlers()
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Create the switch, the hosts and their shaped links."""
        cleanup_stale(self.config.prefix)
        if self.switch in _namespaces():
            raise LabError(f"namespace {self.switch} exists already (another lab of this "
                           "process?); close it first")
        self.started = True
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.host_ns):
            self._add_host(i, ns)

    def _add_host(self, i: int, ns: str) -> None:
        port = f"p{i}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", port, "netns", self.switch, "type", "veth", "peer", "name",
            IFNAME, "netns", ns)
        _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME)
        _sh("ip", "-n", ns, "link", "set", IFNAME, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        rate = self.config.rate
        if rate is not None:
            self._shape(ns, IFNAME, rate)
            self._shape(self.switch, port, rate)

    @staticmethod
    def _shape(ns: str, dev: str, rate: float, verb: str = "add") -> None:
        # burst: at least 64 KiB (a GSO segment) or 2 ms at line rate; queue up to 100 ms.
        burst = max(64 * 1024, int(rate / 8 * 0.002))
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", dev, "root", "tbf",
            "rate", f"{int(rate)}bit", "burst", str(burst), "latency", "100ms")

    def set_rate(self, bandwidth: str) -> None:
        """Change every link's rate now, while ranks run (``tc qdisc replace``): the lab's
        way to make the network change under a job. ``"unshaped"`` removes the shaping.

        >>> lab.set_rate("20mbit")  # doctest: +SKIP
        """
        if not self.started:
            raise LabError("the lab is not started; use `with NetworkLab(...) as lab:`")
        rate = parse_rate(bandwidth)
        for i, ns in enumerate(self.host_ns):
            for where, dev in ((ns, IFNAME), (self.switch, f"p{i}")):
                if rate is None:
                    _sh("ip", "netns", "exec", where, "tc", "qdisc", "del", "dev", dev, "root",
                        check=False)
                else:
                    self._shape(where, dev, rate, verb="replace")
        self.config = dataclasses.replace(self.config, bandwidth=bandwidth)

    def close(self) -> None:
        """Kill the ranks and delete every namespace of this lab (idempotent)."""
        self.kill_ranks()
        if self.started:
            for ns in [*self.host_ns, self.switch]:
                _kill_namespace(ns)
            self.started = False
        self._restore_signal_handlers()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def kill_ranks(self) -> None:
        """SIGTERM, then SIGKILL, every rank still running."""
        alive = [p for p in self._procs if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        for p in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs = []

    def _install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: FrameType | None) -> None:
            raise KeyboardInterrupt(f"signal {signum}")  # unwinds through __exit__

        with contextlib.suppress(ValueError):  # only possible in the main thread
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)  # type: ignore[arg-type]
        self._old_handlers = {}

    # -- addresses, counters ---------------------------------------------------------------
    @staticmethod
    def address(host: int) -> str:
        """IPv4 address of host ``host``."""
        return f"{SUBNET}.{host + 1}"

    def tx_bytes(self, host: int) -> int:
        """Bytes host ``host`` has sent on its link (interface counter, frames included)."""
        out = _sh("ip", "netns", "exec", self.host_ns[host], "cat",
                  f"/sys/class/net/{IFNAME}/statistics/tx_bytes")
        return int(out.strip())

    # -- ranks -------------------------------------------------------------------------------
    def rank_env(self, rank: int, threads: int = 1) -> dict[str, str]:
        """torch.distributed's variables for ``rank`` (host = rank // ranks_per_host)."""
        per_host = self.config.ranks_per_host
        host = rank // per_host
        return {"RANK": str(rank), "WORLD_SIZE": str(self.config.world_size),
                "LOCAL_RANK": str(rank % per_host), "LOCAL_WORLD_SIZE": str(per_host),
                "GROUP_RANK": str(host), "MASTER_ADDR": self.address(0),
                "MASTER_PORT": str(MASTER_PORT), "GLOO_SOCKET_IFNAME": IFNAME,
                "HEXAGRAM_HOST": f"host{host}", "OMP_NUM_THREADS": str(threads),
                "HEXAGRAM_LAB_IFNAME": IFNAME}

    def spawn(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
              threads: int = 1) -> list[subprocess.Popen[bytes]]:
        """Start ``argv`` once per rank inside its host; output goes to ``rank<r>.log``."""
        if not self.started:
            raise LabError("the lab is not started; use `with NetworkLab(...) as lab:`")
        self.kill_ranks()
        envs = [{**os.environ, **(env or {}), **self.rank_env(rank, threads)}
                for rank in range(self.config.world_size)]
        per_host = self.config.ranks_per_host
        procs = start_ranks(argv, envs, self.workdir,
                            prefix=lambda rank: ["ip", "netns", "exec",
                                                 self.host_ns[rank // per_host]])
        self._procs = procs
        return procs

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout: float = 600.0, threads: int = 1, grace: float = 15.0) -> list[RankResult]:
        """Run ``argv`` on every rank until all exit; kill them at ``timeout`` seconds, or
        ``grace`` seconds after the first failure (its peers would otherwise wait for it)."""
        codes = wait_ranks(self.spawn(argv, env, threads), timeout, grace)
        self.kill_ranks()
        return [RankResult(r, r // self.config.ranks_per_host, code, self._tail(r))
                for r, code in enumerate(codes)]

    def _tail(self, rank: int, chars: int = 3000) -> str:
        path = self.workdir / f"rank{rank}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def ranks_failed_message(self, results: Sequence[RankResult]) -> str:
        """Text naming the failed ranks with their output tails (empty if all succeeded)."""
        bad = [r for r in results if r.returncode != 0]
        def status(r: RankResult) -> str:
            return "killed at the deadline" if r.returncode is None else f"exit {r.returncode}"

        return "\n".join(f"--- rank {r.rank} (host {r.host}): {status(r)} ---\n{r.output}"
                         for r in bad)

