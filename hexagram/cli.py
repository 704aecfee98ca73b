"""The ``hexagram`` command: demo, bench, train, plan, advise, simulate, elastic-store/run.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their command runs.

Example:
    $ hexagram demo
    $ hexagram --version
    $ hexagram plan --model gpt --layers 24 --cluster 2x8 --json plan.json
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from hexagram import __version__
from hexagram.errors import MissingExtraError

__all__ = ["COMMANDS", "main"]

#: command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("hexagram.demo", "train on real data with a few local ranks and compare "
             "algorithms (uses the network lab when it can)"),
    "bench": ("hexagram.bench.cli", "step-time benchmark of algorithms against PyTorch DDP on "
              "emulated networks"),
    "train": ("hexagram.bench.train", "time-to-accuracy on real data for each algorithm"),
    "plan": ("hexagram.parallel.cli", "plan automatic model parallelism for a model and cluster"),
    "advise": ("hexagram.bench.advise", "recommend an algorithm for a measured network"),
    "simulate": ("hexagram.bench.simulate_cli", "predict every algorithm's step time on a "
                 "cluster you do not have (device, link presets, 8 to 4096 devices)"),
    "elastic-store": ("hexagram.elastic.store_command", "host live mode's store and "
                      "membership service (one per job, on a machine that stays up)"),
    "elastic-run": ("hexagram.elastic.run_command", "start one live-mode replica on this "
                    "machine and restart it when it dies"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hexagram", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hexagram {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hexagram`` console script (and ``python -m hexagram``).

    A missing optional dependency ends the command with one line naming the
    ``pip install "hexagram[EXTRA]"`` that brings it (exit code 2), not a traceback.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args or args[0] not in COMMANDS:
        if args and args[0] not in ("-h", "--help"):
            parser.parse_args(args[:1])  # --version prints and exits; a typo exits 2
        parser.print_help()
        return 0
    try:
        return _run(args[0], args[1:])
    except MissingExtraError as exc:
        print(f"hexagram {args[0]}: {exc}", file=sys.stderr)
        return 2


def _run(command: str, argv: list[str]) -> int:
    module_name, help_text = COMMANDS[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"hexagram {command}: not available in this build ({module_name} missing)",
              file=sys.stderr)
        return 2
    sub = argparse.ArgumentParser(prog=f"hexagram {command}", description=help_text)
    module.add_arguments(sub)
    return int(module.run(sub.parse_args(argv)) or 0)

if __name__ == "__main__":
    raise SystemExit(main())
