"""The network probe on real collectives (2 ranks, loopback), and a peer that is gone."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import hexagram as hx
from hexagram.comm.communicator import Communicator
from hexagram.cost.probe import COLLECTIVES, NetworkProfile, ProbeError, probe
from hexagram.launch import run_local


def _probe() -> dict[str, Any]:
    hx.init()
    group = dist.new_group([0, 1])
    comm = Communicator(group, timedelta(seconds=60), "probe")
    net = probe(comm, budget_s=0.5)
    comm.close()
    hx.shutdown()
    return net.to_json()


def test_probe_fits_every_collective_identically_on_all_ranks() -> None:
    a, b = run_local(_probe, 2, timeout=120)
    assert a["fits"] == b["fits"]  # agreed: the slowest rate, the largest latency
    assert set(a["fits"]) == set(COLLECTIVES)
    for fit in a["fits"].values():
        assert fit["rate_bps"] > 0 and fit["latency_s"] >= 0
    assert a["world"] == 2 and a["asymmetry"] >= 1.0
    # CPU: fitted per collective, agreed; both ranks run on this machine's cores
    assert a["cpu"] == b["cpu"] and set(a["cpu"]) == set(COLLECTIVES)
    for fit in a["cpu"].values():
        assert fit["rate_bps"] > 0 and fit["latency_s"] >= 0
    assert a["share"] == b["share"] == 2 / len(os.sched_getaffinity(0))
    assert NetworkProfile.from_json(a).to_json() == a  # the probe file keeps everything


def _peer_gone() -> str:
    hx.init()
    group = dist.new_group([0, 1], timeout=timedelta(seconds=5))
    comm = Communicator(group, timedelta(seconds=5), "probe")
    if hx.get_runtime().rank == 1:
        time.sleep(0.5)
        return "left"  # never probes
    try:
        probe(comm, budget_s=0.5)
    except ProbeError as exc:
        return str(exc)
    return "no error"


def test_unreachable_peer_is_a_clear_error() -> None:
    first, second = run_local(_peer_gone, 2, timeout=120)
    assert second == "left"
    assert "network probe failed on rank 0" in first
    assert "unreachable" in first
