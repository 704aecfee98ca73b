"""Write BENCHMARKS.md: a short index of the measurement pages in docs/benchmarks/.

The measurements themselves live in one dated page per area under docs/benchmarks/ (each
with the commands that reproduce it and the runs that missed a target); the headline
tables are docs/results.md. Run after adding a page:

    .venv/bin/python benchmarks/build_benchmarks_md.py
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("engine", "network", "compression", "compress_cpu", "compressed-algorithms",
         "relaxations", "delay", "auto", "simulate", "robust", "elastic", "planner",
         "integrations", "gpu")
HEADER = """# Benchmarks

The headline results, each with the command that reproduces it, are in
[docs/results.md](docs/results.md) (also the "Results" page of the documentation site,
`make docs`). The full measurement history is one page per area below: every table with its
date, machine (a 2-core x86_64 VM, torch 2.13.0+cpu, gloo, unless the page says otherwise)
and command, including the runs that missed a target and why.

| area | page | dated |
|---|---|---|
"""


def title(page: str) -> str:
    """A page's first heading, without its ``#`` marks."""
    text = (ROOT / "docs" / "benchmarks" / f"{page}.md").read_text()
    return re.sub(r"^#+\s*", "", text.strip().splitlines()[0])


def dates(page: str) -> str:
    """The first and last ISO date the page mentions (``2026-11-21 .. 2026-11-26``)."""
    found = sorted(set(re.findall(r"\b20\d\d-\d\d-\d\d\b",
                                  (ROOT / "docs" / "benchmarks" / f"{page}.md").read_text())))
    if not found:
        return "-"
    return found[0] if len(found) == 1 else f"{found[0]} .. {found[-1]}"


def main() -> None:
    rows = [f"| {title(p)} | [docs/benchmarks/{p}.md](docs/benchmarks/{p}.md) | {dates(p)} |"
            for p in PAGES]
    (ROOT / "BENCHMARKS.md").write_text(HEADER + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
