"""The chaos soak's ledger analysis (:mod:`hexagram.bench.chaos_ledger`) on hand-made
ledgers: lost steps, digest comparison, and a commit that a failed set-up and a later
heal carried forward (its line is written after the heal, under the old epoch)."""

from __future__ import annotations

from hexagram.bench.chaos_ledger import analyse


def _ledgers(**incarnations: list[str]) -> dict[str, list[str]]:
    return {key.lstrip("r"): lines for key, lines in incarnations.items()}


def test_a_clean_run_loses_nothing_and_compares_every_voted_commit() -> None:
    a = ["S 1 0,1 d0 -1 0 1.0", "C 1 1 1 x1 1.1", "C 2 1 1 x2 1.2", "END 2 x2 1.3"]
    b = ["S 1 0,1 d0 -1 0 1.0", "C 1 1 1 x1 1.1", "C 2 1 1 x2 1.2", "END 2 x2 1.3"]
    report = analyse(_ledgers(r0_0=a, r1_0=b), [], 2, weight=False)
    assert report["steps_lost"] == 0
    assert (report["commits_compared"], report["commit_mismatches"]) == (2, 0)
    assert report["final_identical"] is True


def test_an_epoch_that_starts_behind_the_newest_commit_loses_the_difference() -> None:
    a = ["S 1 0,1 d0 -1 0 1.0", "C 1 1 1 x1 1.1", "C 2 1 1 x2 1.2", "C 3 1 1 x3 1.3"]
    b = ["S 2 1 d1 1 1 1.4", "C 2 2 1 y2 1.5"]  # restarted from step 1: steps 2-3 lost
    report = analyse(_ledgers(r0_0=a, r1_1=b), [], 3, weight=False)
    assert report["steps_lost"] == 2
    assert report["lost_at"] == [{"epoch": 2, "started_at": 1, "newest_before": 3}]


def test_digests_that_differ_at_a_voted_commit_are_a_mismatch() -> None:
    a = ["S 1 0,1 d0 -1 0 1.0", "C 1 1 1 x1 1.1"]
    b = ["S 1 0,1 d0 -1 0 1.0", "C 1 1 1 zz 1.1"]
    assert analyse(_ledgers(r0_0=a, r1_0=b), [], 1, weight=False)["commit_mismatches"] == 1


def test_a_commit_carried_forward_by_a_heal_counts_as_the_step_it_committed() -> None:
    # replica 1 commits the round at step 10 in epoch 5 (a commit+join); its set-up of
    # epoch 6 fails; epoch 7 heals it to step 19 from replica 2, which trained steps 11-19
    # alone in epoch 6 (local steps of a weight algorithm). Its C line, written after the
    # heal under epoch 5, says 19: read as written, epoch 6 (starting at 10) lost 9 steps.
    one = ["S 5 1,2 d5 9 9 1.0", "C 19 5 1 healed 2.0", "S 7 1,2 d7 10 19 2.0",
           "C 20 7 1 x20 2.1"]
    two = ["S 5 1,2 d5 9 9 1.0", "C 10 5 1 x10 1.1", "S 6 1,2 d6 10 10 1.2",
           *[f"C {s} 6 0 - 1.{s}" for s in range(11, 20)], "S 7 1,2 d7 19 19 2.0",
           "C 20 7 1 x20 2.1"]
    report = analyse(_ledgers(r1_3=one, r2_4=two), [], 20, weight=True)
    assert report["steps_lost"] == 0, report["lost_at"]
    assert report["commit_mismatches"] == 0
