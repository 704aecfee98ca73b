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
import difflib
from collections.abc import Iterable
from typing import Any

from hexagram.errors import ConfigError

__all__ = ["build_config", "check_choice", "check_float", "check_int", "did_you_mean",
           "unknown_name"]


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


def build_config(cls: type, kwargs: dict[str, Any], owner: str | None = None) -> Any:
    """``cls(**kwargs)`` with a clear error for unknown field names (``owner``: who the
    message names, e.g. ``"algorithm 'diloco'"``; default: the config's algorithm, or its
    class).

    >>> import dataclasses
    >>> @dataclasses.dataclass
    ... class C:
    ...     period: int = 1
    >>> try:
    ...     build_config(C, {"perod": 3}, owner="algorithm 'x'")
    ... except ConfigError as e:
    ...     print(e)
    algorithm 'x' has no field(s) ['perod']: valid are period; did you mean 'period'?
    """
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise ConfigError(f"{owner or _owner(cls)} has no field(s) {unknown}: valid are "
                          f"{', '.join(names)}{did_you_mean(unknown[0], names)}")
    return cls(**kwargs)


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """``"; did you mean 'X'?"`` for the closest of ``valid`` to ``name``, or ``""``.

    >>> did_you_mean("powersdg", ["allreduce", "powersgd"])
    "; did you mean 'powersgd'?"
    """
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown_name(kind: str, name: str, valid: Iterable[str]) -> ConfigError:
    """The one error for a name that is not registered, in the library's one format.

    >>> str(unknown_name("compressor", "topkk", ["fp16", "topk"]))
    "compressor 'topkk' is not registered: valid are fp16, topk; did you mean 'topk'?"
    """
    names = list(valid)
    return ConfigError(f"{kind} {name!r} is not registered: valid are {', '.join(names)}"
                       f"{did_you_mean(str(name), names)}")
