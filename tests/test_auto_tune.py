"""How ``auto`` times its trials (:mod:`hexagram.auto.tune`): which bucket
sizes are distinct configurations, the order of the timed steps and the scores. All
deterministic: step times are given, nothing is timed."""

from __future__ import annotations

import pytest

import hexagram as hx
from hexagram.auto import tune as auto_tune
from hexagram.auto.config import AutoConfig
from hexagram.cost.model import MB, Prediction
from hexagram.cost.profile import ComputeProfile
from hexagram.cost.schedule import TensorSpec
from hexagram.errors import ConfigError

#: the lab's 6.3M MLP (784 -> 1586 -> 1586 -> 1586 -> 10), gradients in ready order
MLP = [("7.bias", (10,)), ("7.weight", (10, 1586)), ("5.bias", (1586,)),
       ("5.weight", (1586, 1586)), ("3.bias", (1586,)), ("3.weight", (1586, 1586)),
       ("1.bias", (1586,)), ("1.weight", (1586, 784))]
LABEL = "powersgd:start_iter=0"


def mlp_profile() -> ComputeProfile:
    specs = [TensorSpec(name, shape) for name, shape in MLP]
    return ComputeProfile(0.01, 0.03, 0.01, specs, [0.005 * i for i in range(len(specs))])


def prediction(label: str, mb: float, step_s: float) -> Prediction:
    return Prediction(label, step_s, 0.0, 0.0, 0.0, 0, int(mb * MB))


def test_layouts_of_the_mlp() -> None:
    """1 and 4 MB give one bucket per layer after the first, 25 and 100 MB two buckets:
    two configurations, not four."""
    layout = auto_tune.layout_of(mlp_profile())
    assert layout(MB) == layout(4 * MB) != layout(25 * MB) == layout(100 * MB)
    assert [len(b) for b in layout(4 * MB)] == [4, 2, 2]
    assert [len(b) for b in layout(25 * MB)] == [4, 4]


def test_distinct_keeps_the_model_order() -> None:
    trials = [(LABEL, 4 * MB), (LABEL, MB), (LABEL, 100 * MB), (LABEL, 25 * MB)]
    kept = auto_tune.distinct(trials, auto_tune.layout_of(mlp_profile()), 3)
    assert kept == [(LABEL, 4 * MB), (LABEL, 100 * MB)]
    assert auto_tune.distinct(trials, lambda b: b, 2) == trials[:2]


def test_auto_times_each_layout_once() -> None:
    """A clear winner's trials: its sizes in predicted order, duplicates of a layout
    dropped, so a size the model ranked third (25 MB) is timed instead of 4 MB, a copy of
    1 MB."""
    algo = hx.algorithms.get("auto", candidates=[LABEL, "allreduce"], verbose=False)
    preds = [prediction(LABEL, 1, 0.10), prediction(LABEL, 4, 0.10),
             prediction(LABEL, 25, 0.104), prediction(LABEL, 100, 0.104),
             prediction("allreduce", 25, 0.5)]
    trials = auto_tune.trials(preds, {}, [], mlp_profile(), algo.config)
    assert trials == [(LABEL, MB), (LABEL, 25 * MB)]


def test_near_tied_algorithms_are_not_deduplicated() -> None:
    algo = hx.algorithms.get("auto", candidates=[LABEL, "fp16"], verbose=False)
    preds = [prediction(LABEL, 4, 0.10), prediction("fp16", 4, 0.102)]
    assert auto_tune.trials(preds, {}, [], mlp_profile(), algo.config) == [
        (LABEL, 4 * MB), ("fp16", 4 * MB)]


def test_visits_take_turns_for_bucket_sizes() -> None:
    """Every other round reversed: a trend over the first steps favours no trial."""
    assert auto_tune.visits(2, 6, True) == [(0, 1), (1, 1), (1, 1), (0, 1), (0, 1), (1, 1)]
    assert auto_tune.visits(3, 7, True) == [(0, 1), (1, 1), (2, 1), (2, 1), (1, 1), (0, 1)]
    assert auto_tune.visits(2, 6, False) == [(0, 3), (1, 3)]
    with pytest.raises(ValueError, match="tune_steps"):
        auto_tune.visits(3, 2, True)


def test_scores_resist_one_slow_step() -> None:
    """A spike in one turn does not decide: each size scores the median of its turns."""
    plan = auto_tune.visits(2, 6, True)  # A B B A A B
    assert auto_tune.scores([0.20, 0.22, 0.23, 0.90, 0.21, 0.22], plan, 2) == [0.21, 0.22]
    assert auto_tune.scores([0.5, 0.2, 0.4, 0.3], [(0, 2), (1, 2)], 2) == [0.2, 0.3]
    with pytest.raises(ValueError, match="step times"):
        auto_tune.scores([0.1], plan, 2)


def test_named_trials() -> None:
    assert auto_tune.named([("a", MB), ("b", 4 * MB)], [0.25, 0.125]) == {
        "a @ 1 MB": 0.25, "b @ 4 MB": 0.125}


def test_tune_steps_must_cover_the_trials() -> None:
    with pytest.raises(ConfigError, match="tune_steps"):
        AutoConfig(tune_buckets=3, tune_steps=2)
    assert AutoConfig(tune_buckets=2, tune_steps=2).tune_steps == 2


def test_bucket_ties_go_to_fewer_buckets() -> None:
    """Sizes measured within bucket_tie of the fastest: the largest is kept; a clear
    difference still decides; between algorithms the exact-sum rule applies instead."""
    sizes = [(LABEL, MB), (LABEL, 25 * MB), (LABEL, 100 * MB)]
    config = AutoConfig()
    assert auto_tune.pick(sizes, [0.200, 0.209, 0.230], {LABEL: True}, config) == 1
    assert auto_tune.pick(sizes, [0.200, 0.215, 0.230], {LABEL: True}, config) == 0
    assert auto_tune.pick(sizes, [0.200, 0.209, 0.230], {LABEL: True},
                          AutoConfig(bucket_tie=0.0)) == 0
    algos = [("fp16", MB), ("allreduce", MB)]
    lossy = {"fp16": True, "allreduce": False}
    assert auto_tune.pick(algos, [0.200, 0.209], lossy, config) == 1
    assert auto_tune.pick(algos, [0.200, 0.230], lossy, config) == 0


def test_bucket_difference_inside_the_trials_own_spread_is_a_tie() -> None:
    """A smaller bucket wins only by more than the trials resolve: with visit times that
    range over 20 % within each trial, a 10 % faster median still keeps the larger size;
    with steady trials the same 10 % decides."""
    sizes = [(LABEL, MB), (LABEL, 25 * MB)]
    plan = auto_tune.visits(2, 6, same_algorithm=True)  # trials 0 1 1 0 0 1
    noisy = [0.18, 0.20, 0.24, 0.20, 0.22, 0.22]        # 0: .18 .20 .22  1: .20 .24 .22
    steady = [0.200, 0.220, 0.221, 0.201, 0.199, 0.222]
    assert auto_tune.spread(noisy, plan, 2) == pytest.approx((0.2 + 0.04 / 0.22) / 2, abs=1e-6)
    assert auto_tune.spread(steady, plan, 2) < 0.02
    config = AutoConfig()
    for times, kept in ((noisy, 1), (steady, 0)):
        score = auto_tune.scores(times, plan, 2)
        noise = auto_tune.spread(times, plan, 2)
        assert auto_tune.pick(sizes, score, {LABEL: True}, config, noise) == kept
    with pytest.raises(ValueError, match="step times"):
        auto_tune.spread([0.2], plan, 2)
