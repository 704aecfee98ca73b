"""The compression guide's table of algorithms with an ``error_feedback`` switch is the
registry's: the same algorithms, the same defaults, and the others refuse the switch.

A new compressed algorithm with (or without) the field fails here until the table says so.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import hexagram as hx
from hexagram.algorithms import registry
from hexagram.errors import ConfigError

PAGE = Path(__file__).resolve().parent.parent / "docs" / "compression.md"


def _table() -> dict[str, bool]:
    """``{algorithm: default}`` of the page's error-feedback table."""
    text = PAGE.read_text()
    start, end = "<!-- error-feedback-table:start -->", "<!-- error-feedback-table:end -->"
    table = text[text.index(start):text.index(end)]
    rows = re.findall(r"^\| `(\w+)` \| (on|off)\b", table, re.M)
    assert rows, "docs/compression.md: the error-feedback table has no rows"
    return {name: default == "on" for name, default in rows}


def _build(name: str, **config: object) -> object:
    return hx.algorithms.get(name, f=0, **config) if name == "robust" \
        else hx.algorithms.get(name, **config)


def _switches() -> dict[str, bool]:
    """``{algorithm: default}`` of every registered algorithm whose config has the field."""
    found = {}
    for name in registry.names():
        config = getattr(_build(name), "config", None)
        if dataclasses.is_dataclass(config) and any(
                f.name == "error_feedback" for f in dataclasses.fields(config)):
            found[name] = bool(config.error_feedback)  # type: ignore[union-attr]
    return found


def test_the_table_lists_exactly_the_algorithms_with_the_switch_and_their_defaults() -> None:
    assert _table() == _switches()


@pytest.mark.parametrize("name", ["fp16", "dgc", "decoupled_momentum"])
def test_the_algorithms_the_page_names_without_the_switch_refuse_it(name: str) -> None:
    assert name in PAGE.read_text() and name not in _table()
    with pytest.raises(ConfigError, match="error_feedback"):
        _build(name, error_feedback=True)


def test_every_listed_algorithm_accepts_both_settings() -> None:
    for name in _table():
        for value in (True, False):
            assert _build(name, error_feedback=value).config.error_feedback is value
