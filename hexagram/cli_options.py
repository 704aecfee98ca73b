"""One vocabulary for the options of the hexagram commands.

An option that two commands share is declared once here (:data:`SHARED`) and added with
:func:`add`, so it has the same name, meaning, type and destination everywhere:

* ``--params``: model size, parameters (about); ``--layers``: depth; ``--width``: width;
  ``--seq``: context length, tokens per sample.
* ``--batch``: the per-rank micro-batch (samples per rank per step), in every command;
  ``--global-batch``: samples per step summed over every rank, where a command needs that.
* ``--algorithms``: comma-separated algorithm labels, in every command that compares them.

Old spellings whose meaning did not change stay as hidden aliases (``aliases=``); an old
spelling whose meaning changed is refused with a line naming the new one (:func:`moved`).
:class:`Parser` prints a bad argument as one line and exits 2; :class:`HelpFormatter` shows
every default.

Example:
    >>> parser = Parser(prog="hexagram example")
    >>> _ = add(parser, "batch", default=32)
    >>> _ = add(parser, "seq", default=64, aliases=("block",))
    >>> args = parser.parse_args(["--block", "128"])
    >>> args.batch, args.seq
    (32, 128)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from hexagram.config import did_you_mean, unknown_name

__all__ = ["SHARED", "AlgorithmLabels", "DevicePreset", "HelpFormatter", "Parser", "Rates",
           "Shared", "add", "checked", "existing_file", "fail", "int_list", "link_preset", "moved",
           "nonnegative_float", "nonnegative_int", "positive_float", "positive_int"]


def fail(prog: str, message: object) -> int:
    """Print ``"PROG: error: MESSAGE"`` as one line on stderr; return exit code 2."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help (unless None, False or already stated there);
    description and epilog paragraphs wrapped, indented lines (examples) kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default in (None, False, [], argparse.SUPPRESS) or "%(default)" in text
                or "default" in text.lower()):
            return text
        return text + " (default: %(default)s)"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for block in textwrap.dedent(text).strip("\n").split("\n\n"):
            lines = block.splitlines()
            if any(line.startswith(" ") for line in lines):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(textwrap.fill(" ".join(lines), width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n\n".join(out)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose error is ONE line, ``PROG: error: MESSAGE``, on stderr
    and exit code 2 (no usage block: ``--help`` has it), showing defaults in its help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # "argument --x: --x 'v': ..." (a check that names its option) says it once
        message = re.sub(r"^argument (--[\w-]+): \1:? ", r"argument \1: ", message)
        raise SystemExit(fail(self.prog, message))


# -- value checks: each returns the value (str values unchanged) or raises ArgumentTypeError


def _number(kind: type, low: float, strict: bool) -> Callable[[str], Any]:
    word = ("> " if strict else ">= ") + f"{low:g}"
    noun = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if value < low or (strict and value == low) or value != value:
            raise argparse.ArgumentTypeError(f"{text!r} must be {word}")
        return value

    parse.__name__ = f"{'positive' if strict else 'nonnegative'}_{kind.__name__}"
    return parse


positive_int = _number(int, 0, strict=True)
nonnegative_int = _number(int, 0, strict=False)
positive_float = _number(float, 0.0, strict=True)
nonnegative_float = _number(float, 0.0, strict=False)


def int_list(text: str) -> list[int]:
    """``"8,64,512"`` -> ``[8, 64, 512]`` (positive integers)."""
    values = [positive_int(w.strip()) for w in text.split(",") if w.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of integers")
    return values


def checked(check: Callable[[str], object]) -> Callable[[str], str]:
    """A type that runs ``check(text)`` (raising ValueError, e.g. ConfigError, or
    SystemExit with a message) and returns ``text`` unchanged."""

    def parse(text: str) -> str:
        try:
            check(text)
        except (ValueError, SystemExit) as exc:
            raise argparse.ArgumentTypeError(str(exc.code if isinstance(exc, SystemExit)
                                                 else exc)) from None
        return text

    parse.__name__ = getattr(check, "__name__", "checked")
    return parse


def existing_file(text: str) -> str:
    """A path that names a readable file."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    return text


def link_preset(text: str) -> str:
    """A link preset of :data:`hexagram.cost.devices.LINKS` or a rate such as ``40gbit``."""
    from hexagram.cost.devices import LINKS, link

    try:
        link(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}{did_you_mean(text, LINKS)}") from None
    return text


@dataclass(frozen=True)
class DevicePreset:
    """A device preset of :data:`hexagram.cost.devices.DEVICES` (``local`` when allowed:
    measure on this machine)."""

    allow_local: bool = False

    def __call__(self, text: str) -> str:
        from hexagram.cost.devices import DEVICES

        known = [*DEVICES, *(["local"] if self.allow_local else [])]
        if text.lower() not in known:
            raise argparse.ArgumentTypeError(str(unknown_name("device", text, known)))
        return text


@dataclass(frozen=True)
class AlgorithmLabels:
    """Comma-separated labels ``NAME[:FIELD=VALUE...]`` whose names ``known()`` lists
    (and ``all`` when ``allow_all``); the text comes back unchanged."""

    known: Callable[[], Iterable[str]]
    allow_all: bool = True

    def __call__(self, text: str) -> str:
        labels = [t.strip() for t in text.split(",") if t.strip()]
        if not labels:
            raise argparse.ArgumentTypeError("expected comma-separated algorithm names")
        if self.allow_all and labels == ["all"]:
            return text
        known = list(self.known())
        for label in labels:
            name, *pairs = label.split(":")
            if name not in known:
                valid = [*known, *(["all"] if self.allow_all else [])]
                raise argparse.ArgumentTypeError(str(unknown_name("algorithm", name, valid)))
            if any("=" not in p for p in pairs):
                raise argparse.ArgumentTypeError(
                    f"{label!r}: expected NAME:FIELD=VALUE[:FIELD=VALUE]")
        return text


def _setting(text: str) -> str:
    key, sep, _value = text.partition("=")
    if not sep or "." not in key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ALGORITHM.FIELD=VALUE, e.g. "
                                         "qsgd.levels=16")
    return text


@dataclass(frozen=True)
class Rates:
    """Comma-separated link rates, each accepted by ``parse`` (which raises ValueError);
    the text comes back unchanged."""

    parse: Callable[[str], object]

    def __call__(self, text: str) -> str:
        rates = [r for r in text.split(",") if r.strip()]
        if not rates:
            raise argparse.ArgumentTypeError("expected a link rate, e.g. 100mbit")
        for rate in rates:
            try:
                self.parse(rate)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        return text


# -- the shared options


@dataclass(frozen=True)
class Shared:
    """One option's name, meaning and type, the same in every command that takes it.

    ``type`` is a function, or a class whose instance (made by :func:`add` from its keyword
    arguments) is the type, when commands differ only in the values they know."""

    help: str
    type: Callable[..., Any] | None = None
    metavar: str | None = None
    action: str | None = None


SHARED: dict[str, Shared] = {
    # the model
    "model": Shared("the model"),
    "params": Shared("model size: parameters (about) of the MLP; cnn and gpt take their size "
                     "from --width and --layers", positive_int, "N"),
    "layers": Shared("depth: MLP hidden layers / GPT blocks", positive_int, "N"),
    "width": Shared("width: GPT embedding (hidden) size / CNN hidden width", positive_int,
                    "N"),
    "seq": Shared("context length: tokens per sample (GPT)", positive_int, "TOKENS"),
    "batch": Shared("per-rank micro-batch: samples (GPT: sequences) per rank per step",
                    positive_int, "N"),
    "global-batch": Shared("global batch: samples (GPT: sequences) per step, summed over "
                           "every rank", positive_int, "N"),
    # the algorithms
    "algorithms": Shared("comma-separated algorithm labels NAME[:FIELD=VALUE...]",
                         AlgorithmLabels, "NAMES"),
    "set": Shared("algorithm config ALGORITHM.FIELD=VALUE (value parsed as JSON; "
                  "repeatable), e.g. --set qsgd.levels=16", _setting, "ALGO.FIELD=VALUE",
                  "append"),
    "bucket-mb": Shared("bucket capacity (MB)", nonnegative_float, "MB"),
    # the run
    "dataset": Shared("training data", None),
    "epochs": Shared("training epochs (at most)", positive_int, "N"),
    "steps": Shared("steps to run", positive_int, "N"),
    "lr": Shared("learning rate", positive_float, "LR"),
    "time-limit": Shared("seconds per algorithm", positive_float, "S"),
    "timeout": Shared("deadline per algorithm (s): a run past it is stopped and reported "
                      "as failed", positive_float, "S"),
    "threads": Shared("torch threads per rank", positive_int, "N"),
    # the network lab
    "hosts": Shared("emulated hosts (network namespaces)", positive_int, "N"),
    "ranks-per-host": Shared("processes per emulated host (loopback inside a host)",
                             positive_int, "N"),
    "bandwidth": Shared("link rate of the emulated hosts, e.g. 100mbit, 1gbit, unshaped",
                        Rates, "RATE"),
    "loopback": Shared("no lab: ranks on 127.0.0.1, unshaped (no root needed)",
                       action="store_true"),
    # a described cluster
    "device": Shared("device preset (datasheet figures)", DevicePreset, "PRESET"),
    "intra": Shared("link preset inside a host", link_preset, "PRESET"),
    "inter": Shared("link preset between hosts, or a rate such as 40gbit", link_preset,
                    "PRESET"),
    # outputs
    "json": Shared("write the results as JSON to FILE", None, "FILE"),
    "plot": Shared("write a PNG plot to FILE", None, "FILE"),
    "markdown": Shared("append the tables (Markdown) to FILE", None, "FILE"),
}


_TYPE_ARGS = ("known", "allow_all", "allow_local", "parse")


def add(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, *,
        default: Any = None, note: str = "", aliases: Sequence[str] = (),
        **kwargs: Any) -> argparse.Action:
    """Add the shared option ``--NAME`` (:data:`SHARED`) with this command's default.

    ``note`` extends the shared help with what is particular to this command (after a
    ``;``); ``aliases`` are old spellings of the SAME meaning, accepted but hidden; other
    keyword arguments go to the shared type when it is a class (e.g. ``known=`` of
    :class:`AlgorithmLabels`) or else to ``add_argument`` (``choices``, ``nargs``,
    ``const``).
    """
    spec = SHARED[name]
    options: dict[str, Any] = {"dest": name.replace("-", "_"), "default": default,
                               "help": spec.help + (f"; {note}" if note else "")}
    if spec.action:
        options["action"] = spec.action
    if spec.action != "store_true":
        type_args = {k: kwargs.pop(k) for k in list(kwargs) if k in _TYPE_ARGS}
        kind = spec.type
        options["type"] = kind(**type_args) if isinstance(kind, type) else kind
        options["metavar"] = spec.metavar
    action = parser.add_argument(f"--{name}", **options, **kwargs)
    action.shared = name  # type: ignore[attr-defined]  # tests/test_cli_vocabulary.py
    hidden = {k: v for k, v in options.items() if k not in ("default", "help", "metavar")}
    for old in aliases:
        parser.add_argument(f"--{old}", **hidden, **kwargs, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    return action


class _Moved(argparse.Action):
    """An old spelling whose meaning changed: using it is an error naming the new one."""

    def __init__(self, *args: Any, message: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.message = message

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string}: {self.message}")


def moved(parser: argparse.ArgumentParser | argparse._ArgumentGroup, old: str,
          message: str) -> None:
    """Refuse ``--OLD`` (an old spelling whose meaning changed) with ``message``, which
    names the new spelling, instead of accepting it with the new meaning."""
    parser.add_argument(f"--{old}", action=_Moved, message=message, nargs="?",
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
