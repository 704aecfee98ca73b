"""``hexagram elastic-store``: host live mode's store and membership service on this machine.

Example:
    $ hexagram elastic-store --port 29400 --max-replicas 4
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    a = parser.add_argument
    a("--port", type=int, default=29400, help="TCP port on every interface (default 29400)")
    a("--max-replicas", type=int, required=True,
      help="the largest membership: replica ids 0..N-1")
    a("--job", default="default", help="job name, so jobs can share one store "
      "(replicas: HEXAGRAM_JOB or elastic-run --job)")


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C or SIGTERM."""
    from hexagram.elastic.service import serve

    serve(args.port, args.max_replicas, job=args.job,
          log=lambda line: print(line, flush=True))
    return 0
