"""The pieces of live mode across machines: the store service publishes the job, replicas
find it from their environment, the supervisor restarts a failed replica (no root needed;
tests/test_elastic_hosts.py runs them together on emulated hosts)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from hexagram import cli
from hexagram.elastic import service
from hexagram.errors import ConfigError
from hexagram.launch import free_port


def test_parse_address() -> None:
    assert service.parse_address("node0:29400") == ("node0", 29400)
    assert service.parse_address("[::1]:5") == ("::1", 5)
    for bad in ("node0", "node0:", ":29400", "node0:http", "node0:70000"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            service.parse_address(bad)


def test_live_address_from_the_environment() -> None:
    one_machine = service.live_address({"MASTER_ADDR": "h", "MASTER_PORT": "7", "RANK": "2",
                                        "WORLD_SIZE": "3", "TORCHELASTIC_RUN_ID": "r"})
    assert (one_machine.host, one_machine.port, one_machine.replica, one_machine.max_size,
            one_machine.prefix) == ("h", 7, 2, 3, "hexagram/live/r/")
    env = {service.ENV_STORE: "node0:29400", service.ENV_REPLICA: "1",
           service.ENV_MAX_REPLICAS: "4", service.ENV_JOB: "exp", "LOCAL_RANK": "2",
           "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}
    across = service.live_address(env)  # torchrun's own variables are not the job's
    assert (across.host, across.port, across.replica, across.max_size, across.prefix) == (
        "node0", 29400, 3, 4, "hexagram/live/exp/")
    with pytest.raises(ConfigError, match="below the largest membership"):
        service.live_address({**env, "LOCAL_RANK": "3"})
    with pytest.raises(ConfigError, match=service.ENV_REPLICA):
        service.live_address({service.ENV_STORE: "node0:29400"})
    with pytest.raises(ConfigError, match="elastic-store"):
        service.live_address({})


@pytest.mark.timeout(60)
def test_store_service_publishes_the_largest_membership() -> None:
    port, stop, lines = free_port(), threading.Event(), []
    thread = threading.Thread(target=service.serve, args=(port, 3),
                              kwargs={"job": "j", "stop": stop, "log": lines.append,
                                      "poll": 0.05})
    thread.start()
    try:
        env = {service.ENV_STORE: f"127.0.0.1:{port}", service.ENV_REPLICA: "2",
               service.ENV_JOB: "j"}
        assert service.live_address(env, timeout=20).max_size == 3
        with pytest.raises(ConfigError, match="largest membership is unknown"):
            service.live_address({**env, service.ENV_JOB: "other"}, timeout=1)
    finally:
        stop.set()
        thread.join(20)
    assert not thread.is_alive() and "up to 3 replicas" in lines[0]


CHILD = """
import os, sys
from pathlib import Path
marker = Path(sys.argv[1])
seen = marker.read_text() if marker.exists() else ""
marker.write_text(seen + os.environ["HEXAGRAM_STORE"] + " " + os.environ["HEXAGRAM_REPLICA"]
                  + " " + os.environ["HEXAGRAM_JOB"] + ";")
sys.exit(0 if seen else 3)   # fails the first time, like a replica whose host died
"""


def test_supervisor_restarts_a_failed_replica_with_the_job_in_its_environment(
        tmp_path: Path) -> None:
    script, marker = tmp_path / "child.py", tmp_path / "runs"
    script.write_text(CHILD)
    code = cli.main(["elastic-run", "--store", "node0:29400", "--replica", "1", "--job", "exp",
                     "--restart-delay", "0", "--", str(script), str(marker)])
    assert code == 0
    assert marker.read_text() == "node0:29400 1 exp;node0:29400 1 exp;"
    marker.unlink()
    assert service.supervise([sys.executable, str(script), str(marker)], store="h:1",
                             replica=0, max_restarts=0) == 3  # no restart left
    with pytest.raises(ConfigError, match="after `--`"):
        service.supervise([], store="h:1", replica=0)
