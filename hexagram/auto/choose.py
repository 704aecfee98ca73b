"""Candidates for ``auto`` and ``advise``: which algorithms, checked, predicted, ranked.

A candidate is a label ``NAME[:FIELD=VALUE...]`` (``"fp16:wire=bf16"``) naming a registered
algorithm and its configuration. :func:`resolve` checks a user's list (unknown names, an
empty set, lossless requested of lossy candidates, delayed ones without ``allow_delay``)
with errors that say what to change; :func:`predict_all` predicts each at each bucket size
and :func:`format_table` prints the ranking with the choice and why. :func:`lr_flags` names
the candidates whose configuration needs another learning rate than the user's optimizer
has (:meth:`lr_note`, e.g. ``signsgd:scaled=false``): ``auto`` never picks them, and its
table shows them flagged with the factor.

Example:
    >>> [label for label, _ in resolve(["allreduce", "fp16:wire=bf16"])]
    ['allreduce', 'fp16:wire=bf16']
    >>> resolve(["allreduce", "fp16"], lossy=False)[0][0]
    'allreduce'
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from hexagram.algorithms import registry
from hexagram.algorithms.base import Algorithm
from hexagram.algorithms.labels import applicable, make, parse_label
from hexagram.algorithms.recipe import LrNote
from hexagram.cost.model import MB, Prediction, predict_any
from hexagram.cost.probe import NetworkProfile
from hexagram.cost.profile import CompressorCost, ComputeProfile
from hexagram.cost.schedule import is_lossy
from hexagram.errors import ConfigError

__all__ = ["BUCKET_MARGIN", "BUCKET_MB", "DEFAULT", "DELAYED", "applicable", "best_per_label",
           "format_table", "lr_flags", "lr_note", "make", "parse_label", "pick_measured",
           "predict_all", "reason", "resolve", "trials", "warming_up"]

#: the synchronous gradient algorithms auto considers by default, at the configs each
#: registry entry declares (``Entry.auto``, :func:`hexagram.algorithms.registry.auto_candidates`)
DEFAULT = registry.auto_candidates()
#: added by ``allow_delay=True``
DELAYED = registry.auto_candidates(delayed=True)
#: bucket capacities (MB) the model compares; the best few are then timed
BUCKET_MB = (1.0, 4.0, 25.0, 100.0)
#: bucket sizes predicted within this fraction of a candidate's fastest count as equal and
#: the largest is taken: the model leaves out the fixed costs of each bucket (hook, set-up
#: of each collective, PowerSGD's two rounds per bucket). In the lab (small GPT, 100 Mbit/s,
#: 4 ranks on 2 cores) PowerSGD at the 1 MB buckets the model preferred by 2 % ran
#: 1.88 s/step, at the default 25 MB 1.47 s
BUCKET_MARGIN = 0.03


def warming_up(algorithm: Algorithm) -> bool:
    """True while ``algorithm`` runs a full-precision warm-up (PowerSGD's ``start_iter``
    steps of allreduce): its steps then are not the ones the model predicts.

    >>> warming_up(make("powersgd")), warming_up(make("powersgd:start_iter=0"))
    (True, False)
    """
    while hasattr(algorithm, "inner") and not hasattr(algorithm.config, "start_iter"):
        algorithm = algorithm.inner
    start = getattr(algorithm.config, "start_iter", 0)
    return bool(getattr(algorithm, "step", 0) < start)


def resolve(candidates: Sequence[str] | None = None, allow_delay: bool = False,
            lossy: bool = True) -> list[tuple[str, Algorithm]]:
    """Checked ``(label, algorithm)`` pairs; ``None`` gives :data:`DEFAULT` (plus
    :data:`DELAYED` with ``allow_delay``), keeping those registered.

    Raises:
        ConfigError: empty set, unknown name, ``auto`` itself, a weight (delayed)
            algorithm without ``allow_delay=True``, or ``lossy=False`` leaving nothing.
    """
    if candidates is None:
        known = set(registry.names())
        candidates = [c for c in DEFAULT + (DELAYED if allow_delay else ())
                      if parse_label(c)[0] in known]
    if isinstance(candidates, str) or not list(candidates):
        raise ConfigError("auto: candidates must be a non-empty list of algorithm names, got "
                          f"{candidates!r}; e.g. candidates=['allreduce', 'powersgd']")
    out = [(label, _checked(label, allow_delay)) for label in candidates]
    if not lossy:
        kept = [(label, a) for label, a in out if not is_lossy(a)]
        if not kept:
            raise ConfigError(
                f"auto: lossy=False keeps only exact-sum algorithms, and none of {list(candidates)}"
                " is one; add 'allreduce' to the candidates or pass lossy=True")
        out = kept
    return out


def _checked(label: str, allow_delay: bool) -> Algorithm:
    name, _ = parse_label(label)
    if name == "auto":
        raise ConfigError("auto: 'auto' cannot be its own candidate")
    if name not in registry.names():
        raise ConfigError(f"auto: unknown candidate {name!r}; registered algorithms: "
                          f"{', '.join(n for n in registry.names() if n != 'auto')}")
    algorithm = make(label)
    if algorithm.kind == "weight" and not allow_delay:
        raise ConfigError(f"auto: candidate {label!r} delays or decentralizes the update; "
                          "pass allow_delay=True to allow it")
    return algorithm


def lr_note(algorithm: Algorithm, optimizers: Sequence[torch.optim.Optimizer] = ()
            ) -> LrNote | None:
    """The learning-rate change ``algorithm``'s configuration needs with ``optimizers``
    (None: a drop-in). Reads the algorithm's ``lr_note`` method, through wrappers.

    >>> lr_note(make("signsgd:scaled=false")).factor, lr_note(make("signsgd"))
    (0.015, None)
    """
    while not hasattr(algorithm, "lr_note") and hasattr(algorithm, "inner"):
        algorithm = algorithm.inner
    note = getattr(algorithm, "lr_note", None)
    return note(optimizers) if callable(note) else None


def lr_flags(candidates: Sequence[tuple[str, Algorithm]],
             optimizers: Sequence[torch.optim.Optimizer] = ()) -> dict[str, str]:
    """``{label: "needs lr x0.015"}`` for each candidate that is not a drop-in with
    ``optimizers``; auto excludes them (an lr change the user did not make), and those
    whose ``refuses(optimizers)`` gives a reason (an optimizer they cannot run on).

    >>> lr_flags([("signsgd:scaled=false", make("signsgd:scaled=false"))])
    {'signsgd:scaled=false': 'needs lr x0.015'}
    """
    out = {}
    for label, algorithm in candidates:
        refusal = getattr(algorithm, "refuses", None)  # e.g. DeMo with Adam
        why = refusal(optimizers) if callable(refusal) else None
        if why:
            out[label] = why
            continue
        note = lr_note(algorithm, optimizers)
        if note is not None and note.factor != 1.0:
            out[label] = f"needs lr x{note.factor:g}"
    return out


def predict_all(candidates: Sequence[tuple[str, Algorithm]], compute: ComputeProfile,
                network: NetworkProfile, costs: Mapping[str, CompressorCost],
                bucket_mb: Sequence[float] = BUCKET_MB) -> list[Prediction]:
    """Every applicable candidate at each bucket size (weight algorithms once), fastest
    predicted first."""
    preds = []
    for label, algorithm in candidates:
        if not applicable(label, network):
            continue
        sizes = [25.0] if algorithm.kind == "weight" else list(bucket_mb)
        for mb in sizes:
            preds.append(predict_any(algorithm, compute, network, costs, label=label,
                                     bucket_bytes=int(mb * MB)))
    return sorted(preds, key=lambda p: p.step_s)


def best_per_label(preds: Sequence[Prediction], margin: float = BUCKET_MARGIN
                   ) -> list[Prediction]:
    """One configuration per candidate, fastest candidate first: the largest bucket size
    predicted within ``margin`` (relative) of the candidate's fastest (see
    :data:`BUCKET_MARGIN`).

    >>> from hexagram.cost.model import Prediction
    >>> def p(label, mb, s):
    ...     return Prediction(label, s, 0.0, 0.0, 0.0, 0, int(mb * MB), [])
    >>> [(q.label, q.bucket_bytes // MB) for q in best_per_label(
    ...     [p("a", 1, 1.00), p("a", 25, 1.02), p("a", 100, 1.2), p("b", 4, 0.9)])]
    [('b', 4), ('a', 25)]
    """
    fastest: dict[str, float] = {}
    for p in preds:
        fastest[p.label] = min(fastest.get(p.label, p.step_s), p.step_s)
    keep: dict[str, Prediction] = {}
    for p in preds:
        held = keep.get(p.label)
        if p.step_s <= fastest[p.label] * (1.0 + margin) and (
                held is None or p.bucket_bytes > held.bucket_bytes):
            keep[p.label] = p
    return sorted(keep.values(), key=lambda p: p.step_s)


def trials(preds: Sequence[Prediction], excluded: Collection[str], tie: float, count: int,
           exact: Collection[str] = ()) -> list[tuple[str, int]]:
    """``(label, bucket bytes)`` configurations to time in the first steps.

    Several candidates predicted within ``tie`` (relative) of the best: the model's error
    is larger than such gaps, so the distinct candidates among them are measured, each at
    its bucket size of :func:`best_per_label`, at most ``count``. When more are that close
    than ``count`` allows, the order of the predictions is no guide, so the trials are
    spread over what separates candidates when the prediction cannot: the best predicted,
    the one sending the fewest wire bytes, the one needing the least CPU per step (its
    :attr:`~hexagram.cost.model.Prediction.cpu_floor_s` where cores are shared), then
    the next predicted; the best ``exact`` (exact-sum) one replaces the last trial when it
    is close and not already in. A clear winner: its best ``count`` bucket sizes.

    >>> from hexagram.cost.model import Prediction
    >>> def p(label, mb, s, wire=0, cpu=0.0):
    ...     return Prediction(label, s, 0.0, 0.0, 0.0, wire, int(mb * MB), [],
    ...                       cpu_floor_s=cpu)
    >>> trials([p("a", 4, 1.0), p("b", 1, 1.05), p("a", 25, 1.2), p("c", 4, 2.0)],
    ...        (), 0.1, 3)
    [('a', 4194304), ('b', 1048576)]
    >>> trials([p("a", 4, 1.0), p("b", 1, 1.05), p("x", 4, 1.06)], (), 0.1, 2, exact=["x"])
    [('a', 4194304), ('x', 4194304)]
    >>> trials([p("a", 4, 1.0), p("a", 25, 1.2), p("c", 4, 2.0)], (), 0.1, 3)
    [('a', 4194304), ('a', 26214400)]
    >>> [t[0] for t in trials([p("a", 4, 1.00, 900, 0.9), p("b", 4, 1.01, 800, 0.8),
    ...                        p("c", 4, 1.02, 700, 0.5), p("d", 4, 1.03, 10, 0.7)],
    ...                       (), 0.1, 3)]
    ['a', 'd', 'c']
    """
    ok = [p for p in preds if p.label not in excluded]
    if not ok:
        return []
    best = min(ok, key=lambda p: p.step_s)
    close = [p for p in best_per_label(ok) if p.step_s <= best.step_s * (1.0 + tie)]
    if len(close) > 1:
        chosen = _spread(close, count)
        first_exact = next((p for p in close if p.label in exact), None)
        if first_exact is not None and first_exact not in chosen:
            chosen[-1] = first_exact  # the exact sum is always measured when it is close
        return [(p.label, p.bucket_bytes) for p in chosen]
    sizes = [p.bucket_bytes for p in sorted(ok, key=lambda p: p.step_s)
             if p.label == best.label]
    return [(best.label, b) for b in sizes[:count]]


def _spread(close: Sequence[Prediction], count: int) -> list[Prediction]:
    """At most ``count`` of ``close`` (fastest predicted first): all of them if they fit,
    else the first, the fewest wire bytes, the least CPU floor, then in predicted order
    (see :func:`trials`)."""
    if len(close) <= count:
        return list(close)
    order = [close[0], min(close, key=lambda p: (p.wire_bytes, p.step_s)),
             min(close, key=lambda p: (p.cpu_floor_s, p.step_s)), *close]
    chosen: list[Prediction] = []
    for p in order:
        if p not in chosen:
            chosen.append(p)
    return chosen[:count]


def pick_measured(trials: Sequence[tuple[str, int]], times: Sequence[float],
                  lossy: Mapping[str, bool], prefer_exact: float) -> int:
    """Index of the trial to keep: the fastest measured, unless it is lossy and an exact-sum
    trial is within ``prefer_exact`` (relative) of it: a gain inside the timing noise is
    not worth a compressed gradient.

    >>> pick_measured([("fp16", 1), ("allreduce", 1)], [0.150, 0.153],
    ...               {"fp16": True, "allreduce": False}, 0.05)
    1
    >>> pick_measured([("fp16", 1), ("allreduce", 1)], [0.150, 0.170],
    ...               {"fp16": True, "allreduce": False}, 0.05)
    0
    """
    best = min(range(len(times)), key=lambda i: times[i])
    if not lossy.get(trials[best][0], False):
        return best
    exact = [i for i, (label, _) in enumerate(trials) if not lossy.get(label, False)
             and times[i] <= times[best] * (1.0 + prefer_exact)]
    return min(exact, key=lambda i: times[i]) if exact else best


def reason(pick: Prediction, preds: Sequence[Prediction], notes: Sequence[str] = ()) -> str:
    """Why ``pick``: its predicted step and messages, the runner-up, the probe's notes."""
    others = [p for p in best_per_label(preds) if p.label != pick.label]
    why = f"fastest predicted: {pick.step_s:.3f} s/step, {pick.describe_schedule()}"
    if others:
        why += f"; next {others[0].label} {others[0].step_s:.3f} s"
    return "; ".join([why, *notes])


def format_table(preds: Sequence[Prediction], chosen: str, reason: str,
                 measured: Mapping[str, float] | None = None,
                 flags: Mapping[str, str] | None = None) -> str:
    """A Markdown table of the best configuration per candidate and the choice; a label
    in ``flags`` (:func:`lr_flags`) is marked excluded, with the reason."""
    rows = ["| candidate | bucket MB | predicted s/step | compute | compression | exposed comm "
            "| wire MB/step |" + (" measured s/step |" if measured else ""),
            "|---|---|---|---|---|---|---|" + ("---|" if measured else "")]
    for p in best_per_label(preds):
        mark = " **<- chosen**" if p.label == chosen else ""
        if flags and p.label in flags:
            mark = f" (excluded: {flags[p.label]})"
        extra = ""
        if measured:
            m = measured.get(p.label)
            extra = f" {m:.3f} |" if m is not None else " |"
        rows.append(f"| {p.label}{mark} | {p.bucket_bytes / MB:g} | {p.step_s:.3f} | "
                    f"{p.compute_s:.3f} | {p.compress_s:.3f} | {p.exposed_s:.3f} | "
                    f"{p.wire_bytes / 1e6:.2f} |{extra}")
    return "\n".join(rows) + f"\nchoice: {chosen} ({reason})"
