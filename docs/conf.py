"""Sphinx configuration of Hexagram's documentation (``make docs`` builds it with -W)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

project = "Hexagram"
author = "The Hexagram authors"
copyright = "2026, the Hexagram authors"  # noqa: A001 (Sphinx's name)
release = (ROOT / "hexagram" / "__init__.py").read_text().split('__version__ = "')[1].split('"')[0]

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 4
# the dated measurement pages (docs/benchmarks/) start at any heading level and link to
# benchmark scripts and result files outside the site
suppress_warnings = ["myst.header"]

# autodoc: optional dependencies are mocked, so the reference builds with torch alone
autodoc_mock_imports = ["lightning", "accelerate", "transformers", "pulp", "highspy", "rich",
                        "matplotlib", "sklearn", "torchft", "byzfl"]
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"Hexagram {release}"
