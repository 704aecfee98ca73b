"""Validation helpers for frozen, keyword-only config dataclasses.

Every check raises :class:`hexagram.errors.ConfigError` naming the field, the value and the
allowed range, e.g. ``ConfigError("MinMax8Config.chunk_size must be an integer >= 1, got
0")``; an algorithm's config (a class attribute ``algorithm`` names it) is named by the
algorithm: ``ConfigError("algorithm 'qsgd': levels must be an integer in [1, 127], got 0")``.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True, kw_only=True)
    ... class C:
    ...     rank: int = 2
    ...     def __post_init__(self) -> None:
    ...         check_int(self, "rank", low=1)
    >>> C(rank=0)
    Traceback (most recent call last):
    ...
    hexagram.errors.ConfigError: C.rank must be an integer >= 1, got 0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from hexagram.errors import ConfigError

__all__ = ["build_config", "check_choice", "check_float", "check_int"]


def _label(obj: Any, field: str) -> str:
    """How messages name a field: ``algorithm 'qsgd': levels`` for an algorithm's config
    (a class attribute ``algorithm`` names it), else ``ClassName.field``."""
    return f"{_owner(type(obj))}{': ' if _algorithm(type(obj)) else '.'}{field}"


def _algorithm(cls: type) -> str:
    name = getattr(cls, "algorithm", "")
    return name if isinstance(name, str) else ""


def _owner(cls: type) -> str:
    name = _algorithm(cls)
    return f"algorithm {name!r}" if name else cls.__name__


def check_int(obj: Any, field: str, low: int | None = None, high: int | None = None) -> None:
    """``obj.field`` is an int in ``[low, high]`` (either bound optional)."""
    value = getattr(obj, field)
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        rng = (f">= {low}" if high is None else f"in [{low}, {high}]") if low is not None \
            else (f"<= {high}" if high is not None else "")
        raise ConfigError(f"{_label(obj, field)} must be an integer {rng}, got {value!r}".replace(
            "integer ,", "integer,"))


def check_float(obj: Any, field: str, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False) -> None:
    """``obj.field`` is a real number within the given (open or closed) bounds."""
    value = getattr(obj, field)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low}"
        hi = "" if high is None else f"{high}" + (")" if high_open else "]")
        rng = f"in {lo or '(-inf'}, {hi or 'inf)'}"
        raise ConfigError(f"{_label(obj, field)} must be a number {rng}, got {value!r}")


def check_choice(obj: Any, field: str, choices: Iterable[Any]) -> None:
    """``obj.field`` is one of ``choices``."""
    value, allowed = getattr(obj, field), list(choices)
    if value not in allowed:
        raise ConfigError(f"{_label(obj, field)} must be one of {allowed}, got {value!r}")


def build_config(cls: type, kwargs: dict[str, Any]) -> Any:
    """``cls(**kwargs)`` with a clear error for unknown field names."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise ConfigError(f"{_owner(cls)} has no field(s) {unknown}; valid fields: {names}")
    return cls(**kwargs)
