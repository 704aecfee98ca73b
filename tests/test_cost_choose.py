"""Which configurations auto times in its first steps (choose.trials), by hand."""

from __future__ import annotations

from hexagram.auto.choose import trials
from hexagram.cost.model import MB, Prediction


def p(label: str, step_s: float, wire: int, cpu: float = 0.0, mb: float = 4) -> Prediction:
    return Prediction(label, step_s, 0.0, 0.0, 0.0, wire, int(mb * MB), [], cpu_floor_s=cpu)


def test_close_candidates_all_timed_when_they_fit() -> None:
    preds = [p("fp16", 1.40, 9_680_000), p("allreduce", 1.45, 19_350_000),
             p("qsgd", 1.70, 2_460_000)]
    assert [t[0] for t in trials(preds, (), 0.1, 3)] == ["fp16", "allreduce"]


def test_more_close_than_the_budget_spreads_over_wire_and_cpu() -> None:
    # the 1 Gbit/s GPT cell of cvf (auto's profile): 7 candidates within 10 %, 3 trials;
    # PowerSGD sends the fewest bytes, onebit needs the least CPU: both timed with the
    # best predicted, though 4th and 6th in predicted order
    preds = [p("fp16", 1.400, 9_680_000, 1.30), p("bytegrad", 1.401, 4_880_000, 1.31),
             p("dgc", 1.402, 1_550_000, 1.32), p("powersgd", 1.403, 290_000, 1.33),
             p("topk", 1.404, 1_550_000, 1.34), p("onebit", 1.46, 1_210_000, 1.20),
             p("allreduce", 1.48, 19_350_000, 1.40), p("qsgd", 1.70, 2_460_000, 1.6)]
    assert [t[0] for t in trials(preds, (), 0.1, 3)] == ["fp16", "powersgd", "onebit"]
    # the exact sum, when close, replaces the last trial
    assert [t[0] for t in trials(preds, (), 0.1, 3, exact=["allreduce"])] == \
        ["fp16", "powersgd", "allreduce"]
    # excluded candidates are never timed (onebit then has the fewest bytes and least CPU)
    assert [t[0] for t in trials(preds, ("powersgd",), 0.1, 3)] == \
        ["fp16", "onebit", "bytegrad"]


def test_unshared_cores_fill_with_the_next_predicted() -> None:
    # no CPU floor (cpu 0 everywhere): the least-CPU slot falls to the best predicted,
    # already in, so the next predicted fills it
    preds = [p("a", 1.00, 900), p("b", 1.01, 800), p("c", 1.02, 700), p("d", 1.03, 10)]
    assert [t[0] for t in trials(preds, (), 0.1, 3)] == ["a", "d", "b"]
    assert [t[0] for t in trials(preds, (), 0.1, 2)] == ["a", "d"]


def test_clear_winner_times_its_bucket_sizes() -> None:
    preds = [p("a", 1.0, 10, mb=4), p("a", 1.2, 10, mb=25), p("b", 2.0, 5)]
    assert trials(preds, (), 0.1, 3) == [("a", 4 * MB), ("a", 25 * MB)]
    assert trials([], (), 0.1, 3) == []
