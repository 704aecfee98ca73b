"""Exceptions raised by Hexagram, each naming the problem and the fix."""

from __future__ import annotations

__all__ = [
    "CommError",
    "CommTimeoutError",
    "ConfigError",
    "HexagramError",
    "ModelMismatchError",
    "NonFiniteGradientError",
    "NotInitializedError",
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
