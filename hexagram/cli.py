"""The ``hexagram`` command: demo, bench, train, plan, advise, simulate, elastic-store/run.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their command runs. The options two
commands share mean the same in both (:mod:`hexagram.cli_options`); a bad argument is one
line on stderr and exit code 2.

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
from hexagram.cli_options import Parser, fail
from hexagram.config import did_you_mean
from hexagram.errors import ConfigError, MissingExtraError

__all__ = ["COMMANDS", "build_parser", "main"]

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

#: the top-level help's text, plain (no markup: it is printed as is)
DESCRIPTION = ("Data-parallel training with compressed communication: benchmark, train, "
               "plan, advise and simulate from the command line.")
EPILOG = """\
Run 'hexagram COMMAND --help' for a command's options (with their defaults). The options
that several commands take mean the same in each: --params (model size), --layers, --width,
--seq (tokens per sample), --batch (samples per rank per step), --global-batch, --algorithms.

examples:
  hexagram demo
  hexagram bench --loopback --hosts 2 --algorithms ddp,allreduce,powersgd --steps 5
  hexagram simulate --model gpt --layers 24 --width 2048 --seq 1024 --batch 8
  hexagram plan --model gpt --layers 24 --cluster 2x8 --json plan.json"""


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hexagram", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"hexagram {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def build_parser(command: str) -> argparse.ArgumentParser:
    """The parser of ``hexagram COMMAND`` (its module imported; the command not run)."""
    module_name, help_text = COMMANDS[command]
    module = importlib.import_module(module_name)
    parser = Parser(prog=f"hexagram {command}", description=help_text)
    module.add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hexagram`` console script (and ``python -m hexagram``).

    A bad argument, a missing input or a missing optional dependency ends the command with
    one line on stderr (``hexagram COMMAND: error: ...``; for a missing extra, the
    ``pip install "hexagram[EXTRA]"`` that brings it) and exit code 2, not a traceback.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args or args[0] not in COMMANDS:
        if args and args[0].startswith("-") and args[0] not in ("-h", "--help"):
            parser.parse_args(args[:1])  # --version prints and exits; a typo exits 2
        elif args and args[0] not in ("-h", "--help"):
            raise SystemExit(fail("hexagram", f"argument COMMAND: invalid choice: "
                                  f"{args[0]!r} (choose from {', '.join(COMMANDS)})"
                                  f"{did_you_mean(args[0], COMMANDS)}"))
        parser.print_help()
        return 0
    try:
        return _run(args[0], args[1:])
    except MissingExtraError as exc:
        print(f"hexagram {args[0]}: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:  # a value the parser could not check alone
        return fail(f"hexagram {args[0]}", exc)
    except SystemExit as exc:  # sys.exit("message") of a check deeper in the command
        if isinstance(exc.code, str):
            return fail(f"hexagram {args[0]}", exc.code)
        raise


def _run(command: str, argv: list[str]) -> int:
    module_name = COMMANDS[command][0]
    try:
        parser = build_parser(command)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"hexagram {command}: not available in this build ({module_name} missing)",
              file=sys.stderr)
        return 2
    module = sys.modules[module_name]
    return int(module.run(parser.parse_args(argv)) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
