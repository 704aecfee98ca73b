"""How ``auto`` times its trial configurations in the first steps (pure, no timing here).

Two rules, both measured in the bucket study (docs/benchmarks/auto.md, "Autotuned
buckets"):

- **Distinct layouts only.** Bucket sizes that give the same buckets over the job's
  gradients run the same code: timing both measures noise twice and leaves a real
  alternative untimed (the 6.3M MLP: 1 and 4 MB both give one bucket per layer, 25 and
  100 MB both two buckets). :func:`distinct` keeps the first trial of each layout.
- **Interleaved visits, median.** Trials of one algorithm differ only in bucket size: a
  switch is a bucket rebuild (auto leaves its own time and the rebuild's out of the step),
  so they take turns one step at a time, each round in the reverse order of the last
  (A B B A A B: the first steps after wrapping are slower, and a fixed order would favour
  the trial that comes later in every round), and each scores the median of its steps; a
  slow moment of a shared machine then hits every trial alike instead of one trial's
  whole block. Trials of different algorithms each build a fresh algorithm (groups,
  threads, warm starts), so they keep one block each and score the fastest step of it
  (the first step pays the set-up; noise only adds time).
- **Ties go to fewer buckets.** Bucket sizes measured within ``bucket_tie`` of the fastest,
  or within the trials' own step-to-step range (:func:`spread`) when that is larger,
  count as equal and the largest is kept (:func:`pick_bucket`): each bucket has fixed
  costs that the model leaves out (PowerSGD's two collectives, QR and hand-off per bucket:
  2 buckets ran 5-7 % faster than 3 on the MLP in the study), and a median of 3 steps on a
  shared machine cannot resolve less.

Example:
    >>> visits(2, 6, same_algorithm=True)
    [(0, 1), (1, 1), (1, 1), (0, 1), (0, 1), (1, 1)]
    >>> visits(3, 6, same_algorithm=False)
    [(0, 2), (1, 2), (2, 2)]
    >>> scores([0.30, 0.20, 0.21, 0.25, 0.90, 0.22], visits(2, 6, True), 2)
    [0.3, 0.21]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any

from hexagram.auto import choose
from hexagram.cost.model import MB, Prediction, bucket_layout
from hexagram.cost.profile import ComputeProfile

__all__ = ["distinct", "layout_of", "named", "pick", "pick_bucket", "scores", "spread", "trials",
           "visits"]


def trials(preds: Sequence[Prediction], excluded: Collection[str], exact: Collection[str],
           compute: ComputeProfile, config: Any) -> list[tuple[str, int]]:
    """:func:`hexagram.auto.choose.trials` with ``config``'s ``tie`` and ``tune_buckets``;
    for a clear winner, its bucket sizes in the model's order, one per distinct bucket
    layout over ``compute``'s gradients (:func:`distinct`)."""
    found = choose.trials(preds, excluded, config.tie, config.tune_buckets, exact)
    if len(found) < 2 or len({label for label, _ in found}) != 1:
        return found
    every = choose.trials(preds, excluded, config.tie, len(config.bucket_mb), exact)
    return distinct(every, layout_of(compute), config.tune_buckets)


def layout_of(compute: ComputeProfile, first_bucket_bytes: int = MB
              ) -> Callable[[int], tuple[tuple[str, ...], ...]]:
    """``bucket bytes -> the buckets' tensor names`` over ``compute``'s gradients in their
    ready order (the engine's rule, :func:`hexagram.cost.model.bucket_layout`)."""
    def layout(size: int) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(s.name for s in specs)
                     for specs, _ in bucket_layout(compute, size, first_bucket_bytes))
    return layout


def named(trials: Sequence[tuple[str, int]], score: Sequence[float]) -> dict[str, float]:
    """``{"4 MB": 0.21}`` (one algorithm) or ``{"fp16 @ 4 MB": 0.21}``: the decision's
    record of the timed trials.

    >>> named([("a", MB), ("a", 25 * MB)], [0.2, 0.3])
    {'1 MB': 0.2, '25 MB': 0.3}
    """
    one = len({label for label, _ in trials}) == 1
    return {(f"{b / MB:g} MB" if one else f"{label} @ {b / MB:g} MB"): round(float(t), 4)
            for (label, b), t in zip(trials, score)}


def distinct(trials: Sequence[tuple[str, int]], layout: Callable[[int], Hashable],
             count: int) -> list[tuple[str, int]]:
    """The first ``count`` trials with distinct ``(label, layout(bucket bytes))``, in
    order (the model's preference first).

    >>> distinct([("a", 1), ("a", 4), ("a", 25), ("a", 100)], lambda b: b >= 25, 3)
    [('a', 1), ('a', 25)]
    """
    seen: set[tuple[str, Hashable]] = set()
    out = []
    for label, size in trials:
        key = (label, layout(size))
        if key not in seen:
            seen.add(key)
            out.append((label, size))
    return out[:count]


def visits(n: int, steps: int, same_algorithm: bool) -> list[tuple[int, int]]:
    """``(trial index, steps)`` in the order run: one step per visit in turns, every
    other round reversed, when the trials share their algorithm, else one block of
    ``steps // n`` steps each (at least 1).

    Raises:
        ValueError: ``n`` < 1 or ``steps`` < ``n`` (every trial needs a step).
    """
    if n < 1 or steps < n:
        raise ValueError(f"auto: {n} trials need at least {n} timing steps, got {steps}; "
                         "raise tune_steps or lower tune_buckets")
    if same_algorithm:
        rounds = [list(range(n))[::1 - 2 * (r % 2)] for r in range(steps // n)]
        return [(i, 1) for row in rounds for i in row]
    return [(i, steps // n) for i in range(n)]


def _visit_times(step_s: Sequence[float], plan: Sequence[tuple[int, int]], n: int
                 ) -> list[list[float]]:
    """Per trial, the fastest step of each of its visits (``step_s`` in run order).

    Raises:
        ValueError: ``step_s`` does not hold one time per planned step.
    """
    if len(step_s) != sum(length for _, length in plan):
        raise ValueError(f"auto: {len(step_s)} step times for a plan of "
                         f"{sum(length for _, length in plan)} steps")
    per: list[list[float]] = [[] for _ in range(n)]
    at = 0
    for trial, length in plan:
        per[trial].append(min(step_s[at:at + length]))
        at += length
    return per


def scores(step_s: Sequence[float], plan: Sequence[tuple[int, int]], n: int) -> list[float]:
    """Each trial's score from the steps of ``plan`` (:func:`visits`, ``step_s`` in run
    order): the median over its visits of each visit's fastest step.

    Raises:
        ValueError: ``step_s`` does not hold one time per planned step.
    """
    return [statistics.median(v) for v in _visit_times(step_s, plan, n)]


def spread(step_s: Sequence[float], plan: Sequence[tuple[int, int]], n: int) -> float:
    """The trials' own resolution: over the trials, the median of each trial's range of
    visit times relative to its median (:func:`scores`' per-visit times; 0 with fewer
    than 2 visits a trial). Two medians of 3 steps differ by about one such range from
    noise alone, so a smaller difference between bucket sizes is not resolved.

    >>> spread([0.20, 0.30, 0.25, 0.20, 0.22, 0.24], visits(2, 6, True), 2)
    0.17
    """
    ranges = [(max(v) - min(v)) / statistics.median(v) for v in _visit_times(step_s, plan, n)
              if len(v) > 1 and statistics.median(v) > 0]
    return round(statistics.median(ranges), 6) if ranges else 0.0


def pick_bucket(trials: Sequence[tuple[str, int]], score: Sequence[float], tie: float
                ) -> int:
    """Index of the trial to keep among bucket sizes of one algorithm: the largest size
    scored within ``tie`` (relative) of the fastest (module doc; :func:`pick` passes
    the larger of ``bucket_tie`` and the trials' :func:`spread`).

    >>> pick_bucket([("a", MB), ("a", 25 * MB)], [0.200, 0.208], 0.05)
    1
    >>> pick_bucket([("a", MB), ("a", 25 * MB)], [0.200, 0.220], 0.05)
    0
    """
    best = min(score)
    close = [i for i, t in enumerate(score) if t <= best * (1.0 + tie)]
    return max(close, key=lambda i: trials[i][1])


def pick(trials: Sequence[tuple[str, int]], score: Sequence[float],
         lossy: Mapping[str, bool], config: Any, noise: float = 0.0) -> int:
    """The trial to keep: among bucket sizes of one algorithm :func:`pick_bucket` with
    the larger of ``config.bucket_tie`` and ``noise`` (the trials' :func:`spread`: a
    smaller bucket must be faster by more than the trials resolve); among algorithms
    :func:`hexagram.auto.choose.pick_measured` with ``config.prefer_exact`` (an
    :class:`~hexagram.auto.config.AutoConfig`).

    >>> from hexagram.auto.config import AutoConfig
    >>> pick([("a", MB), ("a", 4 * MB)], [0.20, 0.205], {"a": True}, AutoConfig())
    1
    """
    if len({label for label, _ in trials}) == 1:
        return pick_bucket(trials, score, max(config.bucket_tie, noise))
    return choose.pick_measured(trials, score, lossy, config.prefer_exact)
