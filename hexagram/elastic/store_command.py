"""``hexagram elastic-store``: host live mode's store and membership service on this machine.

Example:
    $ head -c 24 /dev/urandom | base64 > job.token        # share it with the replicas' hosts
    $ hexagram elastic-store --port 29400 --max-replicas 4 --token-file job.token
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    a = parser.add_argument
    a("--port", type=int, default=29400, help="TCP port on every interface (default 29400)")
    a("--max-replicas", type=int, required=True,
      help="the largest membership: replica ids 0..N-1")
    a("--job", default="default", help="job name, so jobs can share one store "
      "(replicas: HEXAGRAM_JOB or elastic-run --job)")
    a("--token-file", default=None, metavar="FILE",
      help="the job token (first line of FILE; default: $HEXAGRAM_TOKEN): only processes "
      "with it can join; without one any process that reaches the port can")


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C or SIGTERM."""
    from hexagram.elastic.job_token import read_token
    from hexagram.errors import ConfigError

    try:
        token = read_token(path=args.token_file)
    except ConfigError as exc:
        print(f"hexagram elastic-store: {exc}", file=sys.stderr)
        return 2

    from hexagram.elastic.service import serve

    serve(args.port, args.max_replicas, job=args.job, token=token,
          log=lambda line: print(line, flush=True))
    return 0
