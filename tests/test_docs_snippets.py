"""The ```python blocks of the documentation's pages run, page by page, as a reader would
paste them: the blocks of one page share a namespace, in order, in a world of size 1 (the
process needs no launcher; the multi-rank paths run in the examples' tests).

A block that cannot run here is preceded by ``<!-- no-run: REASON -->``; each such block is
reported as a skipped test with its reason, so none is silently left out.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hexagram import runtime

DOCS = Path(__file__).resolve().parent.parent / "docs"
#: the guides a user copies from (the dated measurement pages under docs/benchmarks/ are
#: records of runs, their commands are the benchmark scripts)
PAGES = sorted(p.name for p in DOCS.glob("*.md"))
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
_NO_RUN = re.compile(r"<!-- no-run: (.+?) -->\s*$")


def blocks(page: str) -> list[tuple[int, str, str | None]]:
    """(line, code, no-run reason or None) of every ```python block of ``page``."""
    text = (DOCS / page).read_text()
    found = []
    for match in _BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = _NO_RUN.search(before)
        line = text.count("\n", 0, match.start()) + 1
        found.append((line, match.group(1), reason.group(1).strip() if reason else None))
    return found


def test_the_guides_have_snippets() -> None:
    runnable = {page: [b for b in blocks(page) if b[2] is None] for page in PAGES}
    for page in ("getting-started.md", "algorithms.md", "compression.md",
                 "weight-algorithms.md", "delay.md", "planner.md", "gpus.md"):
        assert runnable[page], f"{page} has no runnable python block"


@pytest.mark.parametrize("page", [p for p in PAGES if any(b[2] is None for b in blocks(p))])
def test_page_snippets_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # checkpoints and plots land here
    namespace: dict[str, object] = {"__name__": f"docs_{page[:-3]}"}
    try:
        for line, code, reason in blocks(page):
            if reason is None:
                compiled = compile(code, f"{DOCS / page}:{line}", "exec")
                exec(compiled, namespace)  # the documentation's own code
    finally:
        namespace.clear()  # wrappers go (and close) before the process group does
        if runtime.is_initialized():
            runtime.shutdown()


_SKIPPED = [(page, line, reason) for page in PAGES for line, _code, reason in blocks(page)
            if reason is not None]


@pytest.mark.parametrize(("page", "line", "reason"), _SKIPPED,
                         ids=[f"{p}:{n}" for p, n, _r in _SKIPPED])
def test_no_run_blocks_say_why(page: str, line: int, reason: str) -> None:
    assert len(reason.split()) >= 3, f"{page}:{line}: say why the block cannot run here"
    pytest.skip(f"{page}:{line} not run: {reason}")
