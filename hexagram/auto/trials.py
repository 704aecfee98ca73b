"""Which configurations ``auto`` (:mod:`hexagram.auto.algorithm`) times, agreed on every rank.

The collective half of the trial selection; the pure rules (which predictions are close
enough to time, in which order, how the timed steps score) are in
:mod:`hexagram.auto.tune`.

- :func:`shortlist`: every candidate predicted at every bucket size, and the trials to time;
- :func:`agree`: rank 0's trials broadcast to every rank (their probes differ a little);
- :func:`record`: the decision's table and record of a pick;
- :func:`best`: the trial kept after timing, on the slowest rank's step times;
- :func:`retimed`: the decision record updated with the timed trials.

Example:
    >>> from hexagram.cost.model import MB, Prediction
    >>> pick = Prediction("allreduce", 0.2, 0.1, 0.0, 0.1, 4 * MB, 25 * MB)
    >>> table, decision = record(pick, [pick], [], {})
    >>> decision["label"], decision["bucket_bytes"] == 25 * MB, decision["excluded"]
    ('allreduce', True, {})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from hexagram.algorithms.base import Algorithm
from hexagram.auto import choose
from hexagram.auto import tune as auto_tune
from hexagram.auto.config import AutoConfig
from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator
from hexagram.comm.device import control_tensor, group_tensor
from hexagram.cost.model import Prediction
from hexagram.cost.probe import NetworkProfile
from hexagram.cost.profile import CompressorCost, ComputeProfile
from hexagram.cost.schedule import is_lossy
from hexagram.errors import ConfigError

__all__ = ["agree", "best", "record", "retimed", "shortlist"]

Trial = tuple[str, int]  # (candidate label, bucket bytes)


def shortlist(candidates: Sequence[tuple[str, Algorithm]], compute: ComputeProfile,
              network: NetworkProfile, costs: Mapping[str, CompressorCost],
              flags: Mapping[str, str], config: AutoConfig, provisional: bool = False
              ) -> tuple[list[Prediction], list[Trial]]:
    """Every candidate predicted at each of ``config.bucket_mb`` (only gradient algorithms
    when ``provisional``: the engine built its buckets for one), fastest first, and the
    trials to time (:func:`auto_tune.trials`), the model's pick first.

    Raises:
        ConfigError: no applicable candidate is a drop-in (every one is in ``flags``).
    """
    pool = [(label, a) for label, a in candidates if not provisional or a.kind == "grad"]
    preds = choose.predict_all(pool, compute, network, costs, config.bucket_mb)
    exact = [lb for lb, a in candidates if not is_lossy(a)]
    trials = auto_tune.trials(preds, flags, exact, compute, config)
    if not trials:
        raise ConfigError(f"auto: no applicable candidate is a drop-in for the optimizer's "
                          f"learning rate ({dict(flags)}); add 'allreduce' to candidates")
    return preds, trials


def agree(control: Communicator, labels: Sequence[str], trials: Sequence[Trial],
          tune_buckets: int) -> list[Trial]:
    """Rank 0's ``trials`` on every rank (collective on ``control``): labels travel as
    their index in ``labels``, in a message sized for ``tune_buckets`` trials."""
    flat = [v for label, size in trials for v in (labels.index(label), size)]
    msg = control_tensor([len(trials), *flat, *[0] * (2 * tune_buckets - len(flat))],
                         control)
    primitives.broadcast(control, [msg], src=0).wait()
    pairs = msg[1:1 + 2 * int(msg[0])].view(-1, 2).tolist()
    return [(labels[i], size) for i, size in pairs]


def record(pick: Prediction, preds: Sequence[Prediction], notes: Sequence[str],
           flags: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
    """The printed table of ``preds`` with ``pick`` chosen, and the decision record that
    ``auto`` keeps in its checkpoint (label, predicted step, reason, wire and bucket bytes,
    the excluded candidates)."""
    why = choose.reason(pick, preds, notes)
    table = choose.format_table(preds, pick.label, why, flags=flags)
    decision = {"label": pick.label, "predicted_s": pick.step_s, "reason": why,
                "wire_bytes": pick.wire_bytes, "bucket_bytes": pick.bucket_bytes,
                "excluded": dict(flags)}
    return table, decision


def best(control: Communicator, step_s: Sequence[float], plan: Sequence[tuple[int, int]],
         trials: Sequence[Trial], candidates: Sequence[tuple[str, Algorithm]],
         config: AutoConfig) -> tuple[Trial, list[float]]:
    """The trial to keep and every trial's score, from this rank's ``step_s`` of the timed
    ``plan`` (:func:`auto_tune.visits`) maxed over the ranks (collective on ``control``):
    :func:`auto_tune.pick` with the trials' own noise (:func:`auto_tune.spread`)."""
    times = group_tensor(step_s, control)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=control.group)
    maxed = times.tolist()
    score = auto_tune.scores(maxed, plan, len(trials))
    lossy = {lb: is_lossy(a) for lb, a in candidates}
    noise = auto_tune.spread(maxed, plan, len(trials))
    return trials[auto_tune.pick(trials, score, lossy, config, noise)], score


def retimed(decision: dict[str, Any], pred: Prediction, tuned: dict[str, float],
            tie: float) -> None:
    """Note the timed trials (``tuned``: :func:`auto_tune.named`) and the kept one's bucket
    size in ``decision`` (:func:`record`), in place; when the kept trial ``pred`` is another
    candidate than the model's pick (measured faster, predicted within ``tie``), it takes
    the pick's place and the reason says so."""
    if pred.label != decision["label"]:  # measured faster than the model's pick
        decision.update(label=pred.label, predicted_s=pred.step_s,
                        wire_bytes=pred.wire_bytes, reason=(
                            f"measured best of {len(tuned)} predicted within "
                            f"{tie:.0%}; " + decision["reason"]))
    decision.update(bucket_bytes=pred.bucket_bytes, tuned=tuned)
