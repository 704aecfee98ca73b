"""Exceptions raised by Hexagram, each naming the problem and the fix."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = [
    "MALFORMED",
    "NONFINITE_SUM",
    "CommError",
    "CommTimeoutError",
    "ConfigError",
    "HexagramError",
    "MalformedPayloadError",
    "MissingExtraError",
    "ModelMismatchError",
    "NonFiniteGradientError",
    "NotInitializedError",
    "received",
    "require",
    "step_error",
]


class HexagramError(RuntimeError):
    """Base class of Hexagram's errors."""


class NotInitializedError(HexagramError):
    """A distributed feature was used before :func:`hexagram.init`."""


class ConfigError(ValueError):
    """A configuration value is outside its allowed range (the message names the field)."""


class CommError(HexagramError):
    """A collective failed, typically because a peer died (the message names the operation)."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective did not complete within the configured timeout (a peer stopped answering)."""


class ModelMismatchError(HexagramError):
    """Ranks wrapped models that differ (names the first differing parameter)."""


class NonFiniteGradientError(HexagramError, FloatingPointError):
    """A gradient holds NaN or Inf (names the step and the parameter)."""


class MalformedPayloadError(NonFiniteGradientError):
    """A payload received from a peer is malformed (indices out of range or repeated, scales
    NaN/Inf): every rank raises it at the same step, naming the sending rank where the
    collective lets it be known. A :class:`NonFiniteGradientError` too: its values cannot
    be used."""


#: how every explanation of a malformed payload begins
MALFORMED = "malformed payload"
#: how the explanation of a summed payload that holds NaN/Inf begins (an honest overflow
#: and a corrupted payload look the same in a sum: a non-finite gradient, not "malformed")
NONFINITE_SUM = "non-finite sum"


def received(problem: str) -> bool:
    """True when ``problem`` (a failed step check's explanation) is about what arrived from
    the peers (a malformed payload, a non-finite sum) rather than this rank's own values:
    under ``on_nonfinite="skip"`` every rank skips such a step.

    Example:
        >>> received("non-finite sum: fp16: ..."), received("fp16: gradient of ... passes")
        (True, False)
    """
    return problem.startswith((MALFORMED, NONFINITE_SUM))


def step_error(problem: str) -> NonFiniteGradientError:
    """The error for a failed step check explained by ``problem``:
    :class:`MalformedPayloadError` when it is a malformed payload's explanation (it begins
    with :data:`MALFORMED`), else :class:`NonFiniteGradientError`.

    Example:
        >>> type(step_error("malformed payload: topk: rank 1 sent ...")).__name__
        'MalformedPayloadError'
    """
    if problem.startswith(MALFORMED):
        return MalformedPayloadError(problem)
    return NonFiniteGradientError(problem)


class MissingExtraError(HexagramError, ModuleNotFoundError):
    """An optional dependency is not installed; the message is one line naming the
    ``pip install "hexagram[EXTRA]"`` that brings it. An ``ImportError`` too, so code that
    falls back on a missing module keeps working."""

    def __init__(self, message: str, *, name: str, extra: str) -> None:
        super().__init__(message)
        self.name = name
        self.extra = extra


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` (an optional dependency) or raise :class:`MissingExtraError`.

    ``extra`` is the ``[project.optional-dependencies]`` entry of pyproject.toml that
    installs it; ``feature`` says what needs it, in the user's words.

    Example:
        >>> require("math", extra="data", feature="the digits dataset").sqrt(4.0)
        2.0
        >>> try:
        ...     require("nosuchmod", extra="planner", feature="hexagram plan")
        ... except MissingExtraError as exc:
        ...     print(exc)
        hexagram plan needs nosuchmod, which is not installed: pip install "hexagram[planner]"
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.partition(".")[0]
        if exc.name is None or exc.name.partition(".")[0] != top:
            raise  # the module exists but one of its own imports is broken: show that
        raise MissingExtraError(f"{feature} needs {top}, which is not installed: "
                                f'pip install "hexagram[{extra}]"', name=top,
                                extra=extra) from None
