"""The plan rules every part of the planner reads: the executor's gradient bucket size, and
which Hexagram algorithms may synchronise a stage's gradients (and which the cost model
prices). A leaf: the plan's dataclasses validate themselves here, without calling up into
the executor (:mod:`hexagram.parallel.relax`) or the cost model.

What is refused (:func:`check_dp_algorithm`): weight algorithms (local SGD, DiLoCo,
decentralized, async: they average weights after optimizer steps, not gradients),
algorithms that hook the optimizer (QAdam) or measure every rank (``auto``), and the
wrapper options (``delay``, ``hierarchical``: they hook optimizer steps or group ranks by
host over the whole world).

Example:
    >>> check_dp_algorithm("powersgd", {"rank": 4})
    >>> check_dp_algorithm("local_sgd")
    Traceback (most recent call last):
    ...
    hexagram.errors.ConfigError: dp_algorithm 'local_sgd' cannot synchronise a stage's \
gradients: it averages weights after optimizer steps (a weight algorithm); use a gradient \
algorithm, e.g. allreduce, fp16, powersgd, topk
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hexagram.algorithms import registry
from hexagram.config import unknown_name
from hexagram.errors import ConfigError

__all__ = ["DP_BUCKET_BYTES", "PRICED", "check_dp_algorithm", "check_priced"]

#: capacity of the buckets in which the executor allreduces a stage's gradients over its
#: ``dp`` ranks (PyTorch DDP's default, 25 MB): one collective, so one link latency, per
#: bucket rather than per parameter tensor. The cost model prices the same buckets.
DP_BUCKET_BYTES = 25 * 1024 * 1024
#: algorithms the planner can price (the executor runs any gradient algorithm): those whose
#: registry entry declares ``planner=Planned(...)``
PRICED = registry.planner_priced()
#: gradient algorithms that need more than a process group (they are refused, with why)
_REFUSED = {
    "auto": "it measures compute and the network over every rank of the job",
    "qadam": "it hooks the optimizer (frozen Adam variance), which a stage sync never sees",
}
_EXAMPLES = "allreduce, fp16, powersgd, topk"


def check_dp_algorithm(name: str, options: Mapping[str, Any] | None = None) -> None:
    """Raise a :class:`ConfigError` naming the problem if ``name`` with ``options`` cannot
    synchronise a stage's gradients; unknown names list the valid ones (the registry's
    ``ValueError``), bad options name the field (the config's ``ConfigError``)."""
    from hexagram.algorithms.wrappers import WRAPPER_OPTIONS

    options = dict(options or {})
    wrappers = sorted(k for k in options if k in WRAPPER_OPTIONS)
    if wrappers:
        raise ConfigError(f"dp_algorithm option(s) {wrappers} cannot be used for a stage's "
                          f"sync: they hook optimizer steps or group ranks by host over the "
                          f"whole job; drop them (the stage's dp group is the sync group)")
    entry = registry.entries().get(name)
    if entry is None:
        raise unknown_name("dp_algorithm", name, registry.names())
    if entry.kind == "weight":
        raise ConfigError(f"dp_algorithm {name!r} cannot synchronise a stage's gradients: it "
                          f"averages weights after optimizer steps (a weight algorithm); use "
                          f"a gradient algorithm, e.g. {_EXAMPLES}")
    if name in _REFUSED:
        raise ConfigError(f"dp_algorithm {name!r} cannot synchronise a stage's gradients: "
                          f"{_REFUSED[name]}; use e.g. {_EXAMPLES}")
    registry.get(name, **options)  # the config's own checks (names the bad field)


def check_priced(names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``Constraints.dp_algorithms`` checked: usable for a stage's sync and priced by the
    cost model; ``allreduce`` must be among them (the exact sync stays a choice).

    >>> check_priced(["allreduce", "fp16"])
    ('allreduce', 'fp16')
    """
    out = tuple(names)
    for name in out:
        check_dp_algorithm(name)
        if name not in PRICED:
            raise ConfigError(f"Constraints.dp_algorithms: {name!r} is not priced by the "
                              f"planner's cost model; priced: {', '.join(PRICED)} (set any "
                              f"gradient algorithm on a plan's StagePlan.dp_algorithm by hand)")
    if "allreduce" not in out:
        raise ConfigError(f"Constraints.dp_algorithms={out} must include 'allreduce'")
    return out
