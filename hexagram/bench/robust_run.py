"""The robustness benchmark's training runs (``benchmarks/robust.py``): :func:`run_train`,
:func:`hexagram.bench.train.run_train` on loopback that keeps every rank's outcome.

Apart from :mod:`hexagram.bench.robust` (the attack flags and the training-loop pieces
that :mod:`hexagram.bench.train` imports), so that neither imports the other.

Example:
    >>> report = run_train(args)              # doctest: +SKIP
    >>> report["results"][0]["ranks"][0]["error_class"]   # doctest: +SKIP
    'MalformedPayloadError'
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hexagram.bench import train
from hexagram.bench.cli import algorithm_list, parse_settings
from hexagram.bench.harness import LoopbackLab, machine_info, run_task
from hexagram.bench.lab import LabConfig
from hexagram.bench.robust import rank_outcomes

__all__ = ["run_train"]


class _Recording:
    """A lab whose :meth:`run` keeps the last run's exit codes and log tails."""

    def __init__(self, lab: Any) -> None:
        self.lab, self.config = lab, lab.config
        self.codes: list[int | None] = []
        self.logs: list[str] = []

    def run(self, argv: Any, **kwargs: Any) -> Any:
        results = self.lab.run(argv, **kwargs)
        self.codes = [r.returncode for r in results]
        self.logs = [r.output for r in results]
        return results


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`hexagram.bench.train.run_train` on loopback for the robustness benchmark,
    keeping every rank's outcome in each result (``"ranks"``: :func:`rank_outcomes`), so a
    failure reads "every rank raised X at step N", not only the first rank's error."""
    settings = parse_settings(args.set)
    config = LabConfig(hosts=args.hosts, ranks_per_host=args.ranks_per_host,
                       bandwidth="unshaped")
    report: dict[str, Any] = {"machine": machine_info(), "settings": vars(args).copy(),
                              "results": []}
    with LoopbackLab(config) as inner:
        lab = _Recording(inner)
        for name in algorithm_list(args.algorithms):
            print(f"training with {name} ...", file=sys.stderr, flush=True)
            outcome = run_task(lab, train._spec(args, name, settings),  # type: ignore[arg-type]
                               timeout=args.timeout, threads=args.threads)
            summary = train._summary(name, outcome.ranks, outcome.error)
            summary["ranks"] = rank_outcomes(outcome.ranks, lab.codes, lab.logs)
            report["results"].append(summary)
    report["machine"]["load_average_end"] = machine_info()["load_average"]
    return report
