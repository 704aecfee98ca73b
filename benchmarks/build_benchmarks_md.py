"""Assemble BENCHMARKS.md from the per-topic pages in docs/benchmarks/ (keeps them in step).

Each page's title (a leading ``# `` line) becomes a ``## `` section of BENCHMARKS.md; the
rest is copied as is. Run after editing a page:

    .venv/bin/python benchmarks/build_benchmarks_md.py
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("engine", "compression", "compress_cpu", "compressed-algorithms", "relaxations",
         "network", "delay", "auto", "simulate", "robust", "elastic", "planner",
         "integrations")
HEADER = """# Benchmarks

Every figure below was produced by the command shown next to it, on this project's 2-core
x86_64 VM (torch 2.13.0+cpu, gloo) unless the section says otherwise. Several jobs shared
the machine while some of these were taken; ratios measured within one run are the robust
figures. Plots: docs/benchmarks/network_step.png, docs/benchmarks/network_tta.png,
docs/benchmarks/network_text.png. The pages these sections come from are in
docs/benchmarks/ (edit those, then run benchmarks/build_benchmarks_md.py).
"""


def section(page: str) -> str:
    """One page as a section: its ``# Title`` demoted to ``## Title``."""
    text = (ROOT / "docs" / "benchmarks" / f"{page}.md").read_text().strip()
    if text.startswith("# "):
        text = "#" + text
    # images sit next to the pages: point at them from the repository root
    return re.sub(r"\]\((?!http|/)([^)]+\.png)\)",
                  lambda m: f"]({posixpath.normpath('docs/benchmarks/' + m[1])})", text)


def main() -> None:
    body = "\n\n\n".join(section(p) for p in PAGES)
    (ROOT / "BENCHMARKS.md").write_text(HEADER + "\n\n" + body + "\n")


if __name__ == "__main__":
    main()
