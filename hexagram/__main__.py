"""``python -m hexagram``: the same as the ``hexagram`` command.

Example:
    $ python -m hexagram --version
    $ python -m hexagram simulate --help
"""

from hexagram.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
