"""Every repository path the documentation names exists in the checkout.

The README, the guides (``docs/*.md``) and the dated measurement pages
(``docs/benchmarks/*.md``) name source files, scripts, tests and pages: in backticks, in
fenced commands, in links and in prose. A file that is moved or renamed leaves them
pointing at nothing; this test fails naming the page, the line and the path.

Checked: ``hexagram/...py``, ``benchmarks/...py``, ``examples/...py``, ``tests/...py``,
``scripts/...`` and ``docs/...md``, taken from the repository root; link targets relative
to their page. A ``*`` or a ``<placeholder>`` in a name is a pattern that must match at
least one file (``examples/gpt2_*.py``). Not checked: other projects' paths inside a URL
(the path must not follow ``/``, ``.`` or a word character) and names elided with ``...``.

Example:
    >>> named_paths("see `hexagram/cost/model.py`, not https://x.org/tests/a.py")
    [(1, 'hexagram/cost/model.py')]
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]

#: a repository path: not inside a URL or a longer path (no ``/``, ``.``, ``-`` or word
#: character before it), ending at the suffix (``tests/x.py::test_y``, ``x.py.`` at the
#: end of a sentence); scripts/ of any kind, ending on a name character
_PATH = re.compile(
    r"(?<![\w./-])("
    r"(?:hexagram|benchmarks|examples|tests)/[\w./*<>-]*?\.py"
    r"|docs/[\w./*<>-]*?\.md"
    r"|scripts/[\w./*<>-]*[\w*>]"
    r")(?![\w/])")
#: a Markdown link's target, up to an anchor or a title
_LINK = re.compile(r"\]\(([^)#\s]+)")


def named_paths(text: str) -> list[tuple[int, str]]:
    """(line, path) of every repository path ``text`` names, in order."""
    return [(text.count("\n", 0, m.start()) + 1, m[1]) for m in _PATH.finditer(text)
            if "..." not in m[1]]


def exists(path: str, base: Path = ROOT) -> bool:
    """Whether ``path`` (a ``*`` or ``<placeholder>`` matching any name) names a file or
    folder under ``base``."""
    pattern = re.sub(r"<[^>]*>", "*", path)
    if "*" not in pattern:
        return (base / pattern).exists()
    return next(base.glob(pattern), None) is not None


def missing(where: str, text: str, folder: Path) -> list[str]:
    """``where:line: path`` for every path ``text`` names that is not in the checkout, and
    ``where: link TARGET`` for every local link that does not resolve from ``folder``."""
    found = [f"{where}:{line}: {path}" for line, path in named_paths(text)
             if not exists(path)]
    for target in _LINK.findall(text):
        if "://" not in target and not target.startswith("mailto:") \
                and not (folder / target).exists():
            found.append(f"{where}: link {target}")
    return found


def test_every_path_the_documentation_names_exists() -> None:
    found = [entry for page in PAGES
             for entry in missing(str(page.relative_to(ROOT)), page.read_text(), page.parent)]
    assert not found, ("the documentation names paths that are not in the checkout (fix "
                       "the page, or the path):\n" + "\n".join(found))


def test_the_pages_are_read_and_name_paths() -> None:
    """The check above is not vacuous: the pages exist and name many paths."""
    assert (ROOT / "README.md") in PAGES and len(PAGES) > 20
    count = sum(len(named_paths(page.read_text())) for page in PAGES)
    assert count > 200, f"only {count} paths found in {len(PAGES)} pages: is _PATH broken?"


@pytest.mark.parametrize(("text", "paths"), [
    ("`hexagram/elastic/trainer.py`, `quorum.py`", ["hexagram/elastic/trainer.py"]),
    ("pytest tests/test_elastic_live.py::test_x -k starved", ["tests/test_elastic_live.py"]),
    ("run scripts/gpu_check.py.", ["scripts/gpu_check.py"]),
    ("[page](docs/benchmarks/gpu.md#h200)", ["docs/benchmarks/gpu.md"]),
    ("`examples/gpt2_<framework>.py` and `examples/gpt2_*.py`",
     ["examples/gpt2_<framework>.py", "examples/gpt2_*.py"]),
    ("https://github.com/pytorch/pytorch/blob/main/tests/test_x.py", []),
    ("torch/distributed/run.py, ../hexagram/x.py, hexagram/...py", []),
    ("benchmarks/results/elastic_soak.json and hexagram/algorithms/", []),
])
def test_named_paths_finds_repository_paths_only(text: str, paths: list[str]) -> None:
    assert [p for _line, p in named_paths(text)] == paths


def test_a_missing_path_is_reported_with_its_page_and_line() -> None:
    text = ("Restarts (`hexagram/runtime.py`, `hexagram/elastic/rendezvous.py`)\n"
            "`examples/gpt2_<framework>.py`, `examples/nothing_*.py`\n"
            "[guide](elastic.md), [gone](benchmarks/none.md), [web](https://x.org/a.md)\n")
    assert missing("docs/x.md", text, ROOT / "docs") == [
        "docs/x.md:1: hexagram/elastic/rendezvous.py",
        "docs/x.md:2: examples/nothing_*.py",
        "docs/x.md: link benchmarks/none.md",
    ]
