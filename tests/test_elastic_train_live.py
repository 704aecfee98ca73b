"""``hexagram train --live --kill``: live mode from the command line, real processes.

Three replicas train the digits MLP with allreduce; replica 1 is SIGKILLed at step 10,
restarted, and heals. Every run has a timeout; no wall-clock assertion.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hexagram.cli import main


@pytest.mark.timeout(240)
def test_train_live_kill_goes_on_and_the_killed_replica_rejoins(tmp_path: Path) -> None:
    out = tmp_path / "live.json"
    code = main(["train", "--live", "--dataset", "digits", "--hosts", "3",
                 "--algorithms", "ddp,allreduce", "--steps", "200", "--kill", "1@10",
                 "--timeout", "180", "--json", str(out)])
    assert code == 0
    (row,) = json.loads(out.read_text())["results"]  # ddp skipped: it has no live mode
    assert row["algorithm"] == "allreduce" and row["kills"] == 1, row
    assert row["steps_lost"] == 0 and row["dropped_attempts"] >= 1, row
    assert len(row["stall_s"]) == 2  # one recovery on each of the 2 survivors
    assert row["rejoined"] == 1 and row["heal_s"] and not row["errors"], row
    assert row["accuracy_spread"] == 0.0  # all 3 replicas end identical
    assert row["accuracy"] > 0.8  # digits, 200 steps: it trained


def test_train_live_refuses_a_malformed_kill() -> None:
    with pytest.raises(SystemExit) as exit_info:  # checked as it is parsed: one line, exit 2
        main(["train", "--live", "--dataset", "digits", "--kill", "one@ten"])
    assert exit_info.value.code == 2
