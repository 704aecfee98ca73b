"""The README and the guides stay true to the code: the algorithm tables list exactly the
registry's algorithms, the command table the CLI's commands, the extras table
pyproject.toml's extras, the layout every package room, and every link and example resolves.

A new algorithm, command, extra or room fails here until its row is added.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hexagram.algorithms import registry
from hexagram.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _section(text: str, start: str, end: str) -> str:
    return text[text.index(start):text.index(end, text.index(start))]


def _first_column(table: str) -> list[str]:
    """The backticked names of a Markdown table's first column."""
    return re.findall(r"^\| `([^`]+)` \|", table, re.M)


@pytest.mark.parametrize("page", ["README.md", "docs/algorithms.md"])
def test_algorithm_table_equals_the_registry(page: str) -> None:
    table = _section((ROOT / page).read_text(), "<!-- algorithm-table:start -->",
                     "<!-- algorithm-table:end -->")
    listed = _first_column(table)
    assert len(listed) == len(set(listed)), f"{page}: a row is listed twice"
    missing = sorted(set(registry.names()) - set(listed))
    stale = sorted(set(listed) - set(registry.names()))
    assert not missing and not stale, (f"{page}: add rows for {missing}, remove {stale} "
                                       "(hexagram.algorithms.registry.names())")


def test_command_table_equals_the_cli() -> None:
    listed = re.findall(r"^\| `hexagram ([\w-]+)` \|", _section(README, "## Commands", "\n## "),
                        re.M)
    assert listed == list(COMMANDS)


def test_extras_table_equals_pyproject() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = _section(pyproject, "[project.optional-dependencies]", "\n[project.scripts]")
    extras = set(re.findall(r"^([\w-]+) = \[", section, re.M))
    table = _section(README, "| extra | brings | for |", "\n\n")
    listed = {name for cell in re.findall(r"^\| ([^|]+) \|", table, re.M)
              for name in re.findall(r"`([\w-]+)`", cell)}
    assert listed == extras


def test_layout_names_every_package_room() -> None:
    layout = _section(README, "## Layout", "Interfaces:")
    rooms = [p.name for p in (ROOT / "hexagram").iterdir()
             if p.is_dir() and (p / "__init__.py").exists()]
    modules = [p.name for p in (ROOT / "hexagram").glob("*.py")
               if p.name not in ("__init__.py", "__main__.py")]
    missing = [r for r in rooms if f"{r}/" not in layout]
    missing += [m for m in modules if m not in layout]
    assert not missing, f"README's layout lacks {missing}"


def test_links_and_examples_resolve() -> None:
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted(ROOT.glob("docs/**/*.md"))]
    for page in [p for p in pages if "_build" not in p.parts]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), f"{page.name}: broken link {target}"
        for example in re.findall(r"`(examples/[\w.]+\.py)", text):
            assert (ROOT / example).exists(), f"{page.name} names {example}, which is missing"


_LABEL = re.compile(r"\bsessions? \d+|\bsession-\d+|\bh1\d[a-z]?\b|\bissues? \d+|\bissue-\d+", re.I)


def test_no_internal_labels_in_user_facing_files() -> None:
    """Work-item numbers and run or branch labels mean nothing to a user: dates, section
    names and commands instead."""
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "pyproject.toml",
             *ROOT.glob("docs/**/*.md"), *ROOT.glob("hexagram/**/*.py"),
             *ROOT.glob("examples/*.py"), *ROOT.glob("benchmarks/*.py")]
    found = [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m[0]}"
             for path in files if "_build" not in path.parts
             for text in [path.read_text()] for m in _LABEL.finditer(text)]
    assert not found, found


def test_the_algorithms_that_need_optimizers_are_the_ones_listed() -> None:
    import hexagram as hx
    from hexagram.engine.optimizers import needs_optimizers

    sentence = _section(README, "The algorithms that count or hook optimizer steps", "need `")
    listed = set(re.findall(r"`(\w+)`", sentence))
    need = {n for n in registry.names() if n != "auto" and needs_optimizers(
        hx.algorithms.get(n, f=0) if n == "robust" else hx.algorithms.get(n))}
    assert listed == need, f"README lists {sorted(listed)}; these need optimizers: {sorted(need)}"
