"""Live mode (hx.elastic.live): real processes on gloo, one SIGKILLed mid-run.

Each run hosts a c10d TCPStore, starts 3 replica processes, SIGKILLs replica 2 at a step
with hexagram.testing.faults, starts it again, and checks what every replica reports
(hexagram.bench.live). Every run has a timeout; no wall-clock assertion.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hexagram.bench.live import replay, run_live

KILL_AT = 5


def _committed(report: dict[str, Any]) -> list[int]:
    return [step for step, _ in report["log"]]


def test_survivors_lose_no_step_and_the_restarted_rank_heals() -> None:
    results = run_live(world=3, steps=12, kill=f"2@{KILL_AT}", restart=True, sleep=0.01,
                       together=4)
    assert sorted(results) == [0, 1, 2] and results[2]["restarted"]
    survivors = [results[0], results[1]]
    final = results[0]["step"]
    for rep in survivors:
        # every committed step exactly once, in order: nothing lost, nothing applied twice
        assert _committed(rep) == list(range(final)), _committed(rep)
        assert rep["stats"]["failures"] == 1 and len(rep["stats"]["stall_s"]) == 1
        # the step during which replica 2 died was dropped, then redone by the survivors
        assert dict(rep["log"])[KILL_AT] == [0, 1]
        assert dict(rep["log"])[KILL_AT - 1] == [0, 1, 2]
        # the parameters are exactly those of the committed steps, recomputed in one
        # process (a half-applied failed step would show here)
        assert torch.allclose(rep["params"], replay(rep["log"]), rtol=0, atol=1e-12)
    assert survivors[0]["log"] == survivors[1]["log"]
    back = results[2]
    assert back["step"] == final and back["stats"]["heal_s"]
    assert len(back["log"]) >= 4 and all(m == [0, 1, 2] for _, m in back["log"])
    # it trained the last steps together with the survivors: identical parameters
    for rep in survivors:
        assert torch.equal(rep["params"], back["params"])


@pytest.mark.parametrize("policy", ["own", "reset"])
def test_healing_copies_model_optimizer_and_algorithm_state(policy: str) -> None:
    """PowerSGD (compression live from step 2): the restarted replica's model, momentum
    and algorithm state (Q, counters) equal those of the up-to-date member it healed from,
    at the step it joined. Its error-feedback residual is never a copy of the source's
    (that unsent gradient is the source's debt: copied, it would be applied twice; the
    soak's PowerSGD run with 5 kills lost 4.5 points of accuracy that way): with
    ``residuals="own"`` it starts at zero; with ``"reset"`` (the default) the survivors'
    residuals were zeroed when replica 2 died, and at the join every member holds the
    mean of the up-to-date members' (hexagram.elastic.residuals)."""
    results = run_live(world=3, steps=8, kill="2@5", restart=True, sleep=0.01, together=2,
                       algorithm="powersgd", config={"start_iter": 2, "rank": 1},
                       residuals=policy)
    back = results[2]
    (joined_at, digest), = back["digests"].items()
    source = results[0]["digests"][joined_at]  # replica 0: newest step, lowest id
    for part in ("model", "optimizers", "shared"):
        assert digest[part] == source[part], part
    after_kill = results[0]["digests"][5]  # the survivors' epoch after the death
    if policy == "own":
        assert digest["residual_is_zero"] == "True" and source["residual_is_zero"] == "False"
        assert after_kill["residual_is_zero"] == "False"
    else:
        assert after_kill["residual_is_zero"] == "True"  # the dead one's deviation: gone
        assert digest["residual"] == source["residual"]  # the same mean on every member
        assert results[1]["digests"][joined_at]["residual"] == source["residual"]
    assert results[0]["digests"][0]["algorithm"] != source["algorithm"]  # state is live
    assert torch.equal(back["params"], results[0]["params"])
    assert torch.equal(results[1]["params"], results[0]["params"])


def test_a_quorum_below_min_size_is_a_clear_error() -> None:
    results = run_live(world=2, steps=6, kill="1@3", restart=False, min_size=2,
                       join_timeout=2.0, sleep=0.0)
    error = results[0]["error"]
    assert "could not reach 2 replicas" in error and "live replicas [0]" in error, error


@pytest.mark.parametrize("bad", [{"min_size": 0}, {"min_size": 3, "start_size": 2}])
def test_bad_sizes_are_refused(bad: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from hexagram.elastic import live
    from hexagram.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="min_size"):
        live(torch.nn.Linear(2, 2), [], **bad)


@pytest.mark.parametrize("where, words", [
    ("meta", "the model is on meta: move it to the CPU or a CUDA device"),
    ("split", "spans ['cpu', 'meta']"),
])
def test_a_model_gloo_cannot_carry_is_refused_before_any_store(
        where: str, words: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from hexagram.elastic import live
    from hexagram.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")  # no store address: only a check before it runs
    net = torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta"), torch.nn.Linear(2, 2))
    model = net[0] if where == "meta" else net
    with pytest.raises(ConfigError) as info:
        live(model, [], join_timeout=1.0)
    assert words in str(info.value), info.value


def test_replicas_that_find_nobody_training_load_the_durable_checkpoint(tmp_path: Any) -> None:
    first = run_live(world=2, steps=6, kill="", restart=False, min_size=2, together=0,
                     checkpoint_dir=str(tmp_path), checkpoint_every=3)
    second = run_live(world=2, steps=9, kill="", restart=False, min_size=2, together=0,
                      checkpoint_dir=str(tmp_path), checkpoint_every=3)
    for replica in (0, 1):
        assert _committed(first[replica]) == list(range(6))
        assert _committed(second[replica]) == [6, 7, 8]  # resumed at the newest commit
    assert torch.equal(second[0]["params"], second[1]["params"])
    assert torch.allclose(second[0]["params"], replay(first[0]["log"] + second[0]["log"]),
                          rtol=0, atol=1e-12)


def test_local_sgd_votes_only_on_rounds_and_survives_a_kill() -> None:
    """Local SGD (period 3): a vote per averaging round, not per step; a kill is survived
    with no committed step lost and the restarted replica heals. A short collective
    timeout bounds the wait of a survivor blocked in the round (see docs/elastic.md)."""
    results = run_live(world=3, steps=12, kill="2@7", restart=True, sleep=0.01, together=3,
                       algorithm="local_sgd", config={"period": 3}, collective_timeout=5.0)
    survivors = [results[0], results[1]]
    assert survivors[0]["log"] == survivors[1]["log"]
    for rep in survivors:
        assert _committed(rep) == list(range(rep["step"]))
        assert rep["stats"]["failures"] == 1
        # rounds every 3 steps (+ the aborted round): far fewer votes than steps
        assert rep["stats"]["votes"] <= rep["step"] // 3 + 2, rep["stats"]
    assert results[2]["stats"]["heal_s"] and results[2]["step"] == results[0]["step"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("action", ["sigstop", "sigkill"])
def test_a_rank_failing_inside_a_local_sgd_round_does_not_hang_the_survivors(
        action: str) -> None:
    """Replica 2 issues the weight allreduce of a local-SGD round (period 3, the round at
    step 8), then fails: frozen (SIGSTOP: its sockets stay open, so the survivors block in
    the round; it stays frozen to the end, then is SIGKILLed), or SIGKILLed (then
    restarted: it heals). The survivors are woken by Communicator.abort (the watcher saw the
    stale heartbeat or a peer's abort vote), re-form the quorum and finish with identical
    replicas. The collective timeout is 600 s, beyond the run's 90 s deadline: waiting it
    out (what a group abort alone does with gloo's async work) fails the run."""
    restart = action == "sigkill"
    results = run_live(world=3, steps=12, kill=f"2@8:{action}", kill_inside="all_reduce:2",
                       restart=restart, sleep=0.01, together=2, algorithm="local_sgd",
                       config={"period": 3}, collective_timeout=600.0, timeout=90.0,
                       align=3)  # ends right after a round: replicas equal
    survivors = [results[0], results[1]]
    assert survivors[0]["log"] == survivors[1]["log"]
    for rep in survivors:
        assert _committed(rep) == list(range(rep["step"])) and rep["step"] % 3 == 0
        assert rep["stats"]["failures"] == 1
        # the round at step 8 was dropped with replica 2 in it, then redone by the two
        assert dict(rep["log"])[8] == [0, 1] and dict(rep["log"])[7] == [0, 1, 2]
    assert torch.equal(survivors[0]["params"], survivors[1]["params"])
    if restart:
        assert results[2]["stats"]["heal_s"] and results[2]["step"] == results[0]["step"]
        assert torch.equal(results[2]["params"], results[0]["params"])
    else:
        assert sorted(results) == [0, 1]  # the frozen replica never reported


@pytest.mark.timeout(150)
def test_a_starved_replica_and_a_restarted_one_never_train_side_by_side() -> None:
    """Replicas once finished with different parameters: replica 1 is killed at
    step 4 and restarted; replica 0, training alone (min_size 1), is then starved: its
    whole process stopped for 3 s (SIGSTOP, its heartbeat too), so the restarted replica
    finds nobody alive. It must not start an epoch of its own from fresh weights beside
    the starved one (before the fix it did, and the two never met again: the starved one
    waited for a join request that never came). It waits (``behind_grace``, 5 s) for the
    state of the fenced epoch; replica 0 comes back, its pending vote is ``abort``, both
    form one epoch, replica 1 heals from replica 0, and they finish identical."""
    results = run_live(world=2, steps=12, kill="1@4", restart=True, min_size=1, sleep=0.02,
                       together=3, pause="0@6:3", timeout=120.0, join_timeout=30.0)
    assert sorted(results) == [0, 1] and results[1]["restarted"]
    first, back = results[0], results[1]
    assert "error" not in first and "error" not in back, (first.get("error"), back.get("error"))
    assert first["step"] == back["step"]
    assert torch.equal(first["params"], back["params"])
    # replica 0 never lost a committed step, and its trajectory is the committed one
    assert _committed(first) == list(range(first["step"]))
    assert torch.allclose(first["params"], replay(first["log"]), rtol=0, atol=1e-12)
    assert back["stats"]["heal_s"]  # healed from replica 0, not started from scratch
