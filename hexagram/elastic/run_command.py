"""``hexagram elastic-run``: start one live-mode replica on this machine, restart it if it dies.

Example:
    $ GLOO_SOCKET_IFNAME=eth0 hexagram elastic-run --store node0:29400 --replica 1 \\
        -- train.py --steps 1000
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options; the training command follows ``--``."""
    a = parser.add_argument
    a("--store", required=True, help="HOST:PORT of `hexagram elastic-store`")
    a("--replica", type=int, required=True,
      help="this replica's stable id (0..max-replicas-1); a restarted replica, on any "
      "machine, takes the id of the one it replaces")
    a("--job", default="default", help="job name given to elastic-store (default 'default')")
    a("--token-file", default=None, metavar="FILE",
      help="the job token elastic-store was given (first line of FILE; default: "
      "$HEXAGRAM_TOKEN, passed on to the replica)")
    a("--max-restarts", type=int, default=3, help="restarts after a failure (default 3)")
    a("--restart-delay", type=float, default=1.0, help="seconds before a restart")
    a("command", nargs=argparse.REMAINDER, help="-- script.py [args] (or any program)")


def run(args: argparse.Namespace) -> int:
    """Supervise the replica; its last exit code."""
    from hexagram.elastic.job_token import read_token
    from hexagram.errors import ConfigError

    try:
        token = read_token(path=args.token_file)
    except ConfigError as exc:
        print(f"hexagram elastic-run: {exc}", file=sys.stderr)
        return 2

    from hexagram.elastic.service import supervise

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return supervise(command, store=args.store, replica=args.replica, job=args.job,
                     token=token, max_restarts=args.max_restarts, restart_delay=args.restart_delay)
