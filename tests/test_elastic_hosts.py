"""Live mode across (emulated) machines: ``hexagram elastic-store`` on one host,
``hexagram elastic-run`` replicas on two others; one host dies (its replica SIGKILLed) and
the replica is started again on a fourth host, heals from the survivor, and every replica
ends with the parameters of the committed steps replayed in one process. The service and
the replicas share a job token (:mod:`hexagram.elastic.job_token`).

Hosts are network namespaces of the network lab (:mod:`hexagram.bench.lab`): needs root
and iproute2, skipped with the reason otherwise; the namespaces are always removed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hexagram.bench.lab import (
    LabConfig,
    NetworkLab,
    cleanup_stale,
    unavailable_reason,
)
from hexagram.bench.live import replay
from hexagram.elastic.job_token import ENV_TOKEN, job_prefix
from hexagram.launch import die_with_parent

PREFIX = "hxe"
PORT = 29411
TOKEN = "hexagram-test-token"  # the service and every replica share it (who belongs)
REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(Path(__file__).resolve().parent / "_elastic_hosts_replica.py")


def _start(lab: NetworkLab, host: int, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "HEXAGRAM_HOST": f"host{host}",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), ENV_TOKEN: TOKEN}
    with open(log, "wb") as out:
        return subprocess.Popen(["ip", "netns", "exec", lab.host_ns[host], sys.executable,
                                 "-m", "hexagram.cli", *argv], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)


def _replica(lab: NetworkLab, host: int, replica: int, out: Path) -> subprocess.Popen[bytes]:
    store = f"{lab.address(0)}:{PORT}"
    return _start(lab, host, ["elastic-run", "--store", store, "--replica", str(replica),
                              "--max-restarts", "0", "--", SCRIPT, str(out), "30", "2", "0.15"],
                  out / f"host{host}.log")


def _vote_waiter(lab: NetworkLab, index: int) -> subprocess.Popen[str]:
    """A store client inside the store's host (this process is outside every namespace)
    that prints ``ready`` once connected, then ``decided`` once epoch 1 (both replicas)
    has decided its vote ``index``: steps were taken together."""
    code = ("import datetime, torch.distributed as d; s = d.PrefixStore("
            f"'{job_prefix('default', TOKEN)}', d.TCPStore('127.0.0.1', {PORT}, is_master=False, "
            "timeout=datetime.timedelta(seconds=90))); print('ready', flush=True); "
            f"s.wait(['e1/v{index}/decision']); print('decided', flush=True)")
    waiter = subprocess.Popen(["ip", "netns", "exec", lab.host_ns[0], sys.executable, "-c",
                               code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, preexec_fn=die_with_parent)
    # connected before the replicas start: the kill then comes right after that vote
    assert waiter.stdout is not None and "ready" in waiter.stdout.readline()
    return waiter


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.skipif(unavailable_reason() is not None,
                    reason=f"network lab unavailable: {unavailable_reason()}")
def test_replica_of_a_dead_host_restarts_on_another_host_and_heals(tmp_path: Path) -> None:
    cleanup_stale(PREFIX)
    deadline = time.monotonic() + 120
    with NetworkLab(LabConfig(hosts=4, prefix=PREFIX), workdir=tmp_path) as lab:
        procs = [_start(lab, 0, ["elastic-store", "--port", str(PORT), "--max-replicas", "2"],
                        tmp_path / "store.log")]
        try:
            waiter = _vote_waiter(lab, 3)
            procs += [waiter, _replica(lab, 1, 0, tmp_path), _replica(lab, 2, 1, tmp_path)]
            assert "decided" in waiter.stdout.readline()  # type: ignore[union-attr]
            os.killpg(procs[3].pid, signal.SIGKILL)  # host 2 dies: its supervisor and replica
            procs[3].wait(10)
            procs.append(_replica(lab, 3, 1, tmp_path))  # replica 1 again, on host 3
            for p in (procs[2], procs[4]):
                p.wait(max(1.0, deadline - time.monotonic()))
            logs = {p.name: p.read_text(errors="replace")[-3000:]
                    for p in tmp_path.glob("*.log")}
            assert procs[2].returncode == procs[4].returncode == 0, logs
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill() if p is procs[1] else os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
        store_log = (tmp_path / "store.log").read_text()
    assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                          text=True).stdout.split() if n.startswith(PREFIX)]
    survivor = torch.load(tmp_path / "replica0.pt", weights_only=False)
    healed = torch.load(tmp_path / "replica1.pt", weights_only=False)
    assert survivor["step"] == healed["step"] >= 30
    torch.testing.assert_close(healed["params"], survivor["params"], rtol=0, atol=0)
    torch.testing.assert_close(survivor["params"], replay(survivor["log"]), rtol=0,
                               atol=1e-12)
    alone = [s for s, members in survivor["log"] if members == [0]]
    assert alone, "the survivor never trained alone"
    first = healed["memberships"][0]
    assert first["members"] == [0, 1] and first["source"] == 0  # healed from replica 0
    assert "membership 1: replicas [0@-1, 1@-1]" in store_log, store_log
