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


# -- who belongs: the job token ----------------------------------------------------------
TOKEN = "correct horse battery staple"


def _serving(port: int, lines: list[str], **kwargs: object) -> tuple[threading.Thread,
                                                                       threading.Event]:
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(port, 3),
                              kwargs={"job": "j", "stop": stop, "log": lines.append,
                                      "poll": 0.05, **kwargs})
    thread.start()
    return thread, stop


def _stray_bytes(port: int) -> None:
    """What a port scanner or a confused program sends: random bytes, a half message."""
    import os
    import socket

    for payload in (os.urandom(4096), b"\x00" * 3, b"\xff" * 64):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(payload)


@pytest.mark.timeout(90)
def test_a_process_without_the_job_token_cannot_join() -> None:
    import json
    from datetime import timedelta

    import torch.distributed as dist

    port, lines = free_port(), []
    thread, stop = _serving(port, lines, token=TOKEN)
    env = {service.ENV_STORE: f"127.0.0.1:{port}", service.ENV_REPLICA: "1",
           service.ENV_JOB: "j"}
    try:
        with pytest.raises(ConfigError, match="requires the job token"):
            service.live_address(env, timeout=20)
        with pytest.raises(ConfigError, match="wrong job token"):
            service.live_address({**env, service.ENV_TOKEN: "guess"}, timeout=20)
        _stray_bytes(port)  # malformed traffic is dropped; the service keeps serving
        member = service.live_address({**env, service.ENV_TOKEN: TOKEN}, timeout=20)
        assert member.max_size == 3 and TOKEN not in repr(member)
        assert member.prefix.startswith("hexagram/live/j/") and TOKEN not in member.prefix
        # the job's keys are out of a stray client's sight: the public space has only the
        # salted check, and a buggy record in the job's space is reported, not fatal
        root = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=20))
        record = json.loads(root.get("hexagram/live/j/auth").decode())
        assert record["token"] is True and TOKEN not in json.dumps(record)
        assert not root.check(["hexagram/live/j/config"])
        job = dist.PrefixStore(member.prefix, root)
        job.set("epoch", "7")
        job.set("e7/members", "{not json")
        deadline = threading.Event()
        while not any("malformed" in line for line in lines) and not deadline.wait(0.1):
            pass
        job.set("epoch", "8")
        job.set("e8/members", json.dumps({"members": [0, 1], "steps": [5, 5]}))
        while not any("membership 8" in line for line in lines) and not deadline.wait(0.1):
            pass
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join(20)
    assert "job token required" in lines[0] and all(TOKEN not in line for line in lines)
    assert any("malformed record of membership 7" in line for line in lines)
    assert any("membership 8: replicas [0@5, 1@5]" in line for line in lines)


@pytest.mark.timeout(60)
def test_tokens_must_match_on_both_sides() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from hexagram.elastic.job_token import check_token

    port, lines = free_port(), []
    thread, stop = _serving(port, lines)  # no token: said in the log
    try:
        env = {service.ENV_STORE: f"127.0.0.1:{port}", service.ENV_REPLICA: "0",
               service.ENV_JOB: "j"}
        assert service.live_address(env, timeout=20).prefix == "hexagram/live/j/"
        with pytest.raises(ConfigError, match="started without one"):
            service.live_address({**env, service.ENV_TOKEN: TOKEN}, timeout=20)
        root = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=20))
        check_token(root, "j", None)  # what a replica with HEXAGRAM_MAX_REPLICAS checks
        root.set("hexagram/live/k/auth", b"\xff garbage")
        with pytest.raises(ConfigError, match="malformed"):
            check_token(root, "k", None)
        check_token(root, "absent", TOKEN)  # a store without the service: nothing to check
    finally:
        stop.set()
        thread.join(20)
    assert "no job token" in lines[0]


def test_the_commands_take_the_token_from_a_file(tmp_path: Path, capsys) -> None:
    script, marker = tmp_path / "child.py", tmp_path / "seen"
    script.write_text("import os, sys\nfrom pathlib import Path\n"
                      "Path(sys.argv[1]).write_text(os.environ['HEXAGRAM_TOKEN'])\n")
    token = tmp_path / "job.token"
    token.write_text(TOKEN + "\n")
    assert cli.main(["elastic-run", "--store", "h:1", "--replica", "0", "--token-file",
                     str(token), "--", str(script), str(marker)]) == 0
    assert marker.read_text() == TOKEN
    assert cli.main(["elastic-run", "--store", "h:1", "--replica", "0", "--token-file",
                     str(tmp_path / "missing"), "--", str(script), str(marker)]) == 2
    assert "cannot read the job token file" in capsys.readouterr().err
    token.write_text("")
    assert cli.main(["elastic-store", "--max-replicas", "2", "--token-file", str(token)]) == 2
    assert "is empty" in capsys.readouterr().err
