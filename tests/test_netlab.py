"""The network lab: set-up, shaping measured on the link, clean-up on errors and crashes.

Needs root and iproute2 (``ip``, ``tc``); skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from hexagram.bench import lab as lab_module
from hexagram.bench.lab import (
    LabConfig,
    LabUnavailableError,
    NetworkLab,
    cleanup_stale,
    parse_rate,
    unavailable_reason,
)
from hexagram.errors import ConfigError

PREFIX = "hxt"


def _lab_reason() -> str | None:
    return unavailable_reason()


needs_lab = pytest.mark.skipif(_lab_reason() is not None,
                               reason=f"network lab unavailable: {_lab_reason()}")


def _our_namespaces(tag: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag)]


@pytest.fixture(autouse=True)
def _no_stale_namespaces() -> None:
    if _lab_reason() is None:
        cleanup_stale(PREFIX)  # leftovers of killed earlier runs of these tests


def test_parse_rate_units_and_errors() -> None:
    assert parse_rate("100mbit") == 1e8
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("2.5kbit") == 2500.0
    assert parse_rate("unshaped") is None
    for bad in ("100", "fast", "0mbit", "100mb"):
        with pytest.raises(ConfigError, match="bandwidth"):
            parse_rate(bad)
    with pytest.raises(ConfigError, match="hosts"):
        LabConfig(hosts=0)


def test_refuses_clearly_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lab_module.os, "geteuid", lambda: 1000)
    with pytest.raises(LabUnavailableError, match=r"root.*loopback"):
        NetworkLab(LabConfig(hosts=2, prefix=PREFIX))


def test_refuses_clearly_without_tc(monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("the missing-tool message is only reached as root")
    real = lab_module.shutil.which
    monkeypatch.setattr(lab_module.shutil, "which", lambda t: None if t == "tc" else real(t))
    with pytest.raises(LabUnavailableError, match=r"needs tc.*iproute2.*loopback"):
        NetworkLab(LabConfig(hosts=2, prefix=PREFIX))


_SINK = ("import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
         "s.bind(('0.0.0.0',5001));s.listen();c,_=s.accept()\nwhile c.recv(1<<20): pass\n")
_SOURCE = ("import socket,sys,time\ns=socket.create_connection((sys.argv[1],5001))\n"
           "b=bytes(1<<16)\nwhile True: s.sendall(b)\n")


@needs_lab
def test_setup_connectivity_shaping_and_cleanup() -> None:
    """Two hosts at 40 Mbit/s: a TCP stream measured on the interface runs within 15%."""
    config = LabConfig(hosts=2, bandwidth="40mbit", prefix=PREFIX)
    with NetworkLab(config) as lab:
        assert sorted(_our_namespaces(lab.tag)) == sorted([lab.switch, *lab.host_ns])
        sink = subprocess.Popen(["ip", "netns", "exec", lab.host_ns[1], sys.executable, "-c",
                                 _SINK])
        time.sleep(0.5)
        source = subprocess.Popen(["ip", "netns", "exec", lab.host_ns[0], sys.executable,
                                   "-c", _SOURCE, lab.address(1)])
        try:
            time.sleep(0.7)  # past TCP slow start and the token bucket's burst
            b0, t0 = lab.tx_bytes(0), time.monotonic()
            time.sleep(1.5)
            b1, t1 = lab.tx_bytes(0), time.monotonic()
            assert source.poll() is None, "the sender could not reach host 1"
        finally:
            source.kill()
            sink.kill()
            source.wait()
            sink.wait()
        rate = (b1 - b0) * 8 / (t1 - t0)
        assert abs(rate - 40e6) / 40e6 < 0.15, f"measured {rate / 1e6:.1f} Mbit/s for 40"
        tag = lab.tag
    assert _our_namespaces(tag) == []


@needs_lab
def test_rank_crash_stops_peers_and_cleans_up() -> None:
    """Rank 1 fails: its peers are killed after the grace period, nothing is left."""
    code = "import os,sys,time\nif os.environ['RANK']=='1': sys.exit(7)\ntime.sleep(60)\n"
    with NetworkLab(LabConfig(hosts=2, ranks_per_host=2, prefix=PREFIX)) as lab:
        t0 = time.monotonic()
        results = lab.run([sys.executable, "-c", code], timeout=30, grace=1.0)
        assert time.monotonic() - t0 < 10
        assert [r.returncode for r in results] == [None, 7, None, None]
        assert [r.host for r in results] == [0, 0, 1, 1]
        assert "rank 1 (host 0): exit 7" in lab.ranks_failed_message(results)
        tag = lab.tag
    assert _our_namespaces(tag) == []


_OWNER = textwrap.dedent("""
    import sys, time
    from hexagram.bench.lab import LabConfig, NetworkLab
    with NetworkLab(LabConfig(hosts=2, bandwidth="100mbit", prefix="hxt")) as lab:
        procs = lab.spawn([sys.executable, "-c", "import time; time.sleep(120)"])
        print(lab.tag, *[p.pid for p in procs], flush=True)
        time.sleep(120)
""")


def _start_owner() -> tuple[subprocess.Popen[str], str, list[int]]:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    tag, *pids = owner.stdout.readline().split()
    assert _our_namespaces(tag), "the owner did not create its lab"
    return owner, tag, [int(p) for p in pids]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie (reaped by init later) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


@needs_lab
def test_sigterm_to_owner_cleans_up() -> None:
    owner, tag, pids = _start_owner()
    owner.send_signal(signal.SIGTERM)
    owner.wait(timeout=20)
    assert _our_namespaces(tag) == []
    assert all(_gone(p) for p in pids)


@needs_lab
def test_killed_owner_ranks_die_and_stale_lab_is_removed() -> None:
    owner, tag, pids = _start_owner()
    owner.kill()  # SIGKILL: no clean-up code runs
    owner.wait(timeout=10)
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), "ranks outlived their owner"
    assert _our_namespaces(tag), "expected the killed owner's namespaces to remain"
    removed = cleanup_stale(PREFIX)
    assert sorted(removed) == sorted([f"{tag}s", f"{tag}h0", f"{tag}h1"])
    assert _our_namespaces(tag) == []
    assert not list(Path(tempfile.gettempdir()).glob(f"hexagram-lab-{tag}-*"))  # rank logs
