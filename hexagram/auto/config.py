"""Config of ``algorithm="auto"`` (:mod:`hexagram.auto.algorithm`): which candidates, how
the first steps are spent (profiling, timing trials) and when to decide again.

Example:
    >>> AutoConfig(candidates=["allreduce", "powersgd"], tie=0.0).candidates
    ('allreduce', 'powersgd')
"""

from __future__ import annotations

from dataclasses import dataclass

from hexagram.auto import choose
from hexagram.config import check_float, check_int

__all__ = ["AutoConfig"]


@dataclass(frozen=True, kw_only=True)
class AutoConfig:
    """Config of :class:`AutoAlgorithm`.

    Attributes:
        candidates: algorithm labels (``"fp16:wire=bf16"``); None => the synchronous
            gradient algorithms (:data:`hexagram.auto.choose.DEFAULT`).
        allow_delay: also consider local SGD, DiLoCo, decentralized and async (they change
            the optimization: one-step-stale or periodic averaging).
        lossy: False keeps only exact-sum algorithms (allreduce, flat or hierarchical).
        bucket_mb: bucket sizes the model compares; more => a finer search.
        tune_buckets: configurations timed in the first steps: the best predicted bucket
            sizes with distinct bucket layouts, or the candidates predicted within ``tie``.
        tune_steps: steps spent timing them (:mod:`hexagram.auto.tune`: bucket
            sizes take turns a step at a time, median; algorithms one block each); more =>
            a steadier pick, later; at least ``tune_buckets``.
        tie: candidates predicted within this fraction of the best are timed rather than
            trusted to the model (its error on a CPU-bound machine is 10-20 %); 0 => never.
        bucket_tie: after timing bucket sizes of one algorithm, those within this fraction
            of the fastest count as equal and the largest is kept (fewer buckets, fewer
            per-bucket costs; :func:`hexagram.auto.tune.pick_bucket`); 0 => the
            fastest measured.
        prefer_exact: after timing, an exact-sum candidate within this fraction of the
            fastest (lossy) one is kept instead: such a gain is inside the timing noise.
        profile_steps: steps recorded before deciding (the first is not used).
        probe_budget_s: seconds the network probe aims at.
        drift: relative deviation of step time that counts as drifting; lower => re-probes
            sooner.
        drift_steps: consecutive drifting steps that trigger a re-probe.
        redecide: on ``load_state_dict``, decide again instead of keeping the decision.
        verbose: print the decision table on rank 0 (it is always logged at INFO).
    """

    candidates: tuple[str, ...] | None = None
    allow_delay: bool = False
    lossy: bool = True
    bucket_mb: tuple[float, ...] = choose.BUCKET_MB
    tune_buckets: int = 3
    tune_steps: int = 6
    tie: float = 0.1
    bucket_tie: float = 0.05
    prefer_exact: float = 0.05
    profile_steps: int = 3
    probe_budget_s: float = 3.0
    drift: float = 0.25
    drift_steps: int = 20
    redecide: bool = False
    verbose: bool = True

    def __post_init__(self) -> None:
        if self.candidates is not None and not isinstance(self.candidates, str):
            object.__setattr__(self, "candidates", tuple(self.candidates))
        object.__setattr__(self, "bucket_mb", tuple(float(b) for b in self.bucket_mb))
        check_int(self, "tune_buckets", low=1, high=len(self.bucket_mb))
        check_int(self, "tune_steps", low=self.tune_buckets)
        check_int(self, "profile_steps", low=2)
        check_int(self, "drift_steps", low=1)
        check_float(self, "probe_budget_s", low=0.1, high=5.0)
        check_float(self, "drift", low=0.0, low_open=True)
        check_float(self, "tie", low=0.0)
        check_float(self, "prefer_exact", low=0.0)
        check_float(self, "bucket_tie", low=0.0)
        choose.resolve(self.candidates, self.allow_delay, self.lossy)  # clear errors now
