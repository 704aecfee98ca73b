"""One vocabulary across the ``hexagram`` commands, and bad arguments as one line.

Every option that two commands take is built from its one definition in
:mod:`hexagram.cli_options` (same destination, type and meaning); every help shows the
defaults; the top-level help is plain text; a bad argument to any command prints exactly
one line on stderr and exits 2. All in process, through :func:`hexagram.cli.main`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from hexagram.cli import COMMANDS, build_parser, main
from hexagram.cli_options import SHARED

ROOT = Path(__file__).resolve().parent.parent

#: options two commands take that are declared elsewhere, with why
ELSEWHERE = {"--job": "hexagram.elastic declares its two commands' options together",
             "--token-file": "hexagram.elastic declares its two commands' options together"}

MARKUP = ("``", "::", ":func:", ":mod:", ":class:", ":data:", ":meth:")


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    return {command: build_parser(command) for command in COMMANDS}


def _visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction)]


def _same_type(action: argparse.Action, name: str) -> bool:
    kind = SHARED[name].type
    return isinstance(action.type, kind) if isinstance(kind, type) else action.type is kind


def test_a_shared_option_means_the_same_in_every_command(
        parsers: dict[str, argparse.ArgumentParser]) -> None:
    where: dict[str, list[tuple[str, argparse.Action]]] = defaultdict(list)
    for command, parser in parsers.items():
        for action in _visible(parser):
            for flag in action.option_strings:
                where[flag].append((command, action))
    shared = {flag: uses for flag, uses in where.items() if len(uses) > 1}
    assert {"--params", "--batch", "--algorithms", "--seq", "--width"} <= set(shared)
    for flag, uses in shared.items():
        if flag in ELSEWHERE:
            continue
        name = flag.removeprefix("--")
        for command, action in uses:
            assert getattr(action, "shared", None) == name, \
                f"hexagram {command} {flag}: declare it with hexagram.cli_options.add"
    for command, parser in parsers.items():
        for action in parser._actions:
            name = getattr(action, "shared", None)
            if name is None:
                continue
            spec = SHARED[name]
            assert action.dest == name.replace("-", "_"), (command, name)
            assert action.help and action.help.startswith(spec.help), (command, name)
            assert spec.action == "store_true" or _same_type(action, name), (command, name)


def test_the_vocabulary(parsers: dict[str, argparse.ArgumentParser]) -> None:
    """--batch is per rank wherever it exists; the planner takes --global-batch; advise's
    candidates are --algorithms; old spellings of the same meaning still parse."""
    for command, parser in parsers.items():
        flags = {f for a in _visible(parser) for f in a.option_strings}
        assert not flags & {"--candidates", "--model-params", "--hidden", "--block"}, command
        if "--batch" in flags:
            batch = next(a for a in parser._actions if "--batch" in a.option_strings)
            assert "per rank" in str(batch.help), command
    plan = parsers["plan"].parse_args(["--hidden", "64", "--global-batch", "8"])
    assert (plan.width, plan.global_batch) == (64, 8)
    sim = parsers["simulate"].parse_args(["--model-params", "5000", "--block", "16"])
    assert (sim.params, sim.seq) == (5000, 16)
    advise = parsers["advise"].parse_args(["--candidates", "allreduce,topk"])
    assert advise.algorithms == "allreduce,topk"
    bench = parsers["bench"].parse_args(["--block", "32"])
    assert bench.seq == 32


def test_every_help_shows_its_defaults(parsers: dict[str, argparse.ArgumentParser]) -> None:
    for command, parser in parsers.items():
        text = " ".join(parser.format_help().split())
        flat = text.replace(" ", "")
        assert not any(m in text for m in MARKUP), command
        for action in _visible(parser):
            if action.default in (None, False, [], argparse.SUPPRESS) or action.nargs == 0:
                continue
            shown = parser._get_formatter()._expand_help(action)
            assert str(action.default) in shown, (command, action.option_strings, shown)
            assert "".join(shown.split()) in flat, (command, action.option_strings)


def test_top_level_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "hexagram COMMAND --help" in out and all(c in out for c in COMMANDS)
    assert not any(m in out for m in MARKUP), out


BAD = [
    (["bench", "--algorithms", "ddp,powersdg"], "did you mean 'powersgd'"),
    (["bench", "--batch", "0"], "--batch"),
    (["bench", "--bandwidth", "100mbt"], "100mbit"),
    (["bench", "--set", "qsgd"], "ALGORITHM.FIELD=VALUE"),
    (["bench", "--steps", "many"], "not an integer"),
    (["train", "--kill", "1@"], "RANK@STEP"),
    (["train", "--attack", "nope", "--loopback"], "unknown attack 'nope'"),
    (["train", "--dataset", "mnist"], "invalid choice"),
    (["simulate", "--device", "h300"], "did you mean"),
    (["simulate", "--inter", "25gb"], "did you mean '25gbe'"),
    (["simulate", "--world", "8,x"], "--world"),
    (["simulate", "--algorithms", "topkk"], "did you mean 'topk'"),
    (["simulate", "--model", "uniform", "--params", "10", "--layers", "24", "--world", "8"],
     "must be >= layers"),
    (["plan", "--cluster", "2y8"], "HOSTSxDEVICES"),
    (["plan", "--batch", "8"], "--global-batch"),
    (["plan", "--dp-algorithms", "powersdg"], "did you mean 'powersgd'"),
    (["plan", "--intra", "nvlink"], "go together"),
    (["advise", "--probe", "no-such-probe.json"], "no such file"),
    (["advise", "--algorithms", "topkk"], "did you mean 'topk'"),
    (["advise", "--module", "nocolon"], "pkg.mod:factory"),
    (["demo", "--algorithms", "ddp"], "'ddp' is not registered"),
    (["demo", "--ranks", "0"], "--ranks"),
    (["elastic-store", "--port", "x"], "--port"),
    (["elastic-run", "--store", "h:1", "--replica", "x", "--", "true"], "--replica"),
    (["bnech"], "did you mean 'bench'"),
]


@pytest.mark.parametrize(("argv", "says"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_argument_is_one_line_and_exit_2(argv: list[str], says: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    prog = f"hexagram {argv[0]}" if argv[0] in COMMANDS else "hexagram"
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    assert says in err, err


def test_a_report_that_is_not_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "report.json"
    bad.write_text("{not json")
    assert main(["advise", "--from", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a `hexagram bench --json` report" in err


def test_the_solver_prints_no_banner() -> None:
    """HiGHS prints its banner on construction, to the C stdout: a fresh process shows it
    unless the planner silences it."""
    pytest.importorskip("highspy")
    code = ("from hexagram.parallel.solver import solve\n"
            "print(solve([3.0, 1.0], [({0: 1.0, 1: 1.0}, 1.0, 1.0)], n_binary=2))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT),
                                                       "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[0.0, 1.0]\n" and "HiGHS" not in proc.stderr
