"""Live mode in the network lab: each replica on its own emulated host ("a
returning rank heals with algorithm state in under 1 s on the lab").

The soak of ``benchmarks/elastic_soak.py`` (the same replicas, faults, data and report,
:func:`hexagram.bench.soak.summarize`), but every replica runs in its own network
namespace behind a shaped link, the c10d store in a process of host 0 (it outlives every
replica), and a killed replica is started again as a fresh process in its namespace
(``ip netns exec``: no fork, so it imports torch and loads the data again, as a real
restart does). Healing therefore crosses the shaped link.

Needs root and iproute2 (the lab). Example:
    $ sudo .venv/bin/python benchmarks/elastic_lab.py --bandwidth 100mbit \\
        --algorithms allreduce,powersgd,diloco --json elastic_lab.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from hexagram.bench.lab import LabConfig, NetworkLab
from hexagram.bench.soak import summarize
from hexagram.launch import supervise
from hexagram.testing.faults import parse_faults

PORT = 29611
REPLICA = ("import sys, json; from hexagram.bench.soak import _replica; "
           "_replica(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), "
           "json.loads(sys.argv[4]), int(sys.argv[5]), sys.argv[6])")
STORE = ("import sys, time, torch.distributed as d; "
         "s = d.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, "
         "wait_for_workers=False); time.sleep(1e6)")


class NetnsProcess:
    """A replica process in a lab host, with the interface ``supervise`` expects of a
    ``multiprocessing.Process`` (``start``, ``is_alive``, ``exitcode``, ``kill``, ``join``,
    ``pid``)."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.argv, self.env, self.log = argv, env, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.is_alive():
            assert self.proc is not None
            self.proc.kill()

    def join(self, timeout: float | None = None) -> None:
        if self.proc is not None:
            self.proc.wait(timeout)


def run_lab_soak(lab: NetworkLab, cfg: dict[str, Any], world: int, out: Path,
                 deadline: float) -> dict[str, Any]:
    """One soak run with the replicas in ``lab``'s hosts; :func:`summarize`'s report."""
    def start(replica: int, incarnation: int) -> NetnsProcess:
        env = {**os.environ, **lab.rank_env(replica)}
        argv = ["ip", "netns", "exec", lab.host_ns[replica], sys.executable, "-c", REPLICA,
                str(replica), str(world), str(cfg["port"]), json.dumps(cfg), str(incarnation),
                str(out)]
        return NetnsProcess(argv, env, out / f"replica{replica}.log")

    started = time.perf_counter()
    procs = {r: start(r, 0) for r in range(world)}
    for p in procs.values():
        p.start()
    kills = Counter(f.rank for f in parse_faults(cfg["kill"]))
    in_time = supervise(procs, start, kills, 1.0, time.monotonic() + deadline)
    for p in procs.values():
        p.kill()
        p.join(10)
    if not in_time:
        raise RuntimeError(f"lab soak overran {deadline:.0f} s; logs in {out}")
    reports = {f.name[7:-3]: torch.load(f, weights_only=False) for f in out.glob("*.pt")}
    return summarize(reports, cfg["steps"], cfg["kill"], time.perf_counter() - started)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--world", type=int, default=4)
    a.add_argument("--bandwidth", default="100mbit")
    a.add_argument("--steps", type=int, default=600)
    a.add_argument("--kill", default="1@100,2@200,3@300,1@400,2@500")
    a.add_argument("--algorithms", default="allreduce,powersgd,diloco")
    a.add_argument("--min-size", type=int, default=2)
    a.add_argument("--deadline", type=float, default=900.0)
    a.add_argument("--json", required=True)
    args = a.parse_args()
    rows = []
    with NetworkLab(LabConfig(hosts=args.world, bandwidth=args.bandwidth)) as lab:
        for i, name in enumerate(args.algorithms.split(",")):
            rows.append({"algorithm": name, "bandwidth": args.bandwidth,
                         **_one_run(lab, args, name, PORT + i)})
            print(json.dumps(rows[-1]), flush=True)
            Path(args.json).write_text(json.dumps(rows, indent=1))


def _one_run(lab: NetworkLab, args: argparse.Namespace, name: str, port: int
             ) -> dict[str, Any]:
    # a fresh store per run, as a torchrun job has: live mode's keys (memberships, the
    # steps replicas finished at) must not carry over from the previous algorithm's run
    store = NetnsProcess(["ip", "netns", "exec", lab.host_ns[0], sys.executable, "-c",
                          STORE, lab.address(0), str(port)], dict(os.environ),
                         Path(tempfile.gettempdir()) / "hx_elastic_lab_store.log")
    store.start()
    cfg = {"steps": args.steps, "kill": args.kill, "algorithm": name, "config": {},
           "dataset": "auto", "batch": 32, "lr": 0.05, "min_size": args.min_size,
           "heartbeat_timeout": 0.5, "timeout": 30.0, "join_timeout": 30.0, "seed": 0,
           "residuals": "reset", "master_addr": lab.address(0), "port": port}
    try:
        with tempfile.TemporaryDirectory() as out:
            return run_lab_soak(lab, cfg, args.world, Path(out), args.deadline)
    finally:
        store.kill()


if __name__ == "__main__":
    main()
