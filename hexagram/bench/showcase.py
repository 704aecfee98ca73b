"""A short slow-link comparison for ``hexagram demo``: DDP against Hexagram algorithms.

Example:
    >>> rows = slow_link_comparison(hosts=4, bandwidth="100mbit", plot="demo.png")
    ... # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hexagram.bench.cli import add_arguments, run_bench
from hexagram.bench.lab import check_available
from hexagram.bench.report import markdown_table, plot_throughput
from hexagram.cli_options import Parser

__all__ = ["PREFERRED", "SETTINGS", "slow_link_comparison"]

#: Hexagram algorithms the demo shows first, when registered.
PREFERRED = ("powersgd", "local_sgd", "qsgd", "bytegrad", "gtopk", "fp16")

#: Compress from the first step, average every 4 steps: short runs then show steady state.
SETTINGS = ("powersgd.start_iter=0", "local_sgd.period=4")


def _default_algorithms(count: int = 3) -> list[str]:
    from hexagram.algorithms import names

    registered = names()
    chosen = [n for n in PREFERRED if n in registered][:count]
    return ["ddp", "allreduce", *chosen]


def slow_link_comparison(hosts: int = 4, bandwidth: str = "100mbit",
                         algorithms: Sequence[str] | None = None, params: int = 2_000_000,
                         steps: int = 6, plot: str | None = "hexagram-demo.png",
                         timeout: float = 300.0, quiet: bool = False) -> list[dict[str, Any]]:
    """Run ``ddp`` and a few Hexagram algorithms on emulated hosts; print a table.

    Args:
        hosts: emulated hosts, one rank each.
        bandwidth: link rate, e.g. ``"100mbit"``.
        algorithms: names (default: ``ddp``, ``allreduce`` and up to three of
            :data:`PREFERRED` that are registered).
        params: MLP parameters; more => communication dominates more.
        steps: timed steps per algorithm (after 2 warm-up steps; PowerSGD compresses from
            the first step and local SGD averages every 4 steps, see :data:`SETTINGS`).
        plot: PNG path for a samples/s bar chart (None: no plot).
        timeout: deadline per algorithm, seconds.
        quiet: no progress bar.

    Returns:
        One summary dict per algorithm (``step_s``, ``samples_per_s``, ``efficiency``...;
        ``error`` for an algorithm that failed or is not registered).

    Raises:
        LabUnavailableError: not root, or ``ip``/``tc`` missing (the message says what to
            run instead).
    """
    check_available()
    parser = Parser(prog="hexagram demo")  # an unknown name: one line, exit code 2
    add_arguments(parser)
    names = list(algorithms) if algorithms is not None else _default_algorithms()
    args = parser.parse_args(["--hosts", str(hosts), "--bandwidth", bandwidth,
                              "--algorithms", ",".join(names), "--params", str(params),
                              "--steps", str(steps), "--min-steps", str(min(steps, 3)),
                              "--warmup", "2", "--timeout", str(timeout),
                              *[arg for item in SETTINGS for arg in ("--set", item)],
                              *(["--quiet"] if quiet else [])])
    report = run_bench(args)
    rows: list[dict[str, Any]] = report["results"][bandwidth]
    print(f"\n{hosts} hosts at {bandwidth}, MLP of {params:,} parameters, batch 32 per rank\n")
    print(markdown_table(rows))
    if plot:
        plot_throughput(report["results"], plot, title=f"{hosts} hosts at {bandwidth}")
        print(f"\nplot: {plot}")
    return rows
