"""The one fit: ``time = rounds x latency + units / rate``, for links and for CPU work.

A link's :class:`Fit` is a latency per message (or per hop) and a rate in bytes per second;
a CPU cost ``a + b n`` is the same line (:meth:`Fit.line`: latency ``a``, rate ``1 / b``
units per second). :func:`fit_line` fits one through measured points (the probe's
collectives, the compressors' encode and decode); :func:`fit_allreduce` fits a ring
allreduce's times to the latency of one of its hops and its link rate (the planner's
calibration).

Example:
    >>> fit = Fit(latency_s=0.001, rate_bps=12.5e6)   # 100 Mbit/s, 1 ms
    >>> round(fit.time(1_250_000), 4)
    0.101
    >>> Fit.line(2e-6, 1e-9).time(1000)               # 2 us + 1 ns per element
    3e-06
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from hexagram.errors import HexagramError

__all__ = ["Fit", "cost_line", "fit_allreduce", "fit_line", "line_through"]


@dataclass(frozen=True)
class Fit:
    """``time = rounds * latency_s + sent / rate_bps`` (bytes, or elements of CPU work)."""

    latency_s: float
    rate_bps: float  # bytes this rank sends per second (CPU work: elements per second)

    def time(self, sent: int, rounds: int = 1) -> float:
        return rounds * self.latency_s + sent / self.rate_bps

    @classmethod
    def line(cls, intercept: float, slope: float) -> Fit:
        """``intercept + slope x n`` as a fit (a slope <= 0: an effectively free unit)."""
        return cls(max(0.0, intercept), 1.0 / slope if slope > 0 else 1e12)

    @property
    def slope(self) -> float:
        """Seconds per unit (byte or element): ``1 / rate_bps``."""
        return 1.0 / self.rate_bps


def fit_line(points: list[tuple[float, float]]) -> Fit:
    """Least-squares ``t = a + x / r`` through (bytes, seconds) points; a slope that noise
    made <= 0 gives an (effectively) infinite rate, a negative intercept 0 latency."""
    xs, ts = [p[0] for p in points], [p[1] for p in points]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var if var > 0 else 0.0
    if slope <= 0:
        return Fit(max(0.0, min(ts)), 1e12)
    return Fit(max(0.0, mt - slope * mx), 1.0 / slope)


def cost_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``t = a + b n`` through ``(n, seconds)`` points of CPU
    work at two sizes or more, neither negative (noise that makes the slope negative gives
    ``b = 0``).

    >>> [round(v, 12) for v in cost_line([(100, 2e-6), (1100, 3e-6)])]
    [1.9e-06, 1e-09]
    """
    mx = statistics.fmean(p[0] for p in points)
    my = statistics.fmean(p[1] for p in points)
    var = sum((p[0] - mx) ** 2 for p in points)
    slope = max(0.0, sum((p[0] - mx) * (p[1] - my) for p in points) / var)
    return max(0.0, my - slope * mx), slope


def line_through(n0: float, t0: float, n1: float, t1: float) -> tuple[float, float]:
    """``(a, b)`` of ``t = a + b n`` through two timed sizes, neither negative (one size:
    all of it per unit).

    >>> [round(v, 12) for v in line_through(100, 2e-6, 1100, 3e-6)]
    [1.9e-06, 1e-09]
    """
    slope = max(0.0, (t1 - t0) / (n1 - n0)) if n1 != n0 else t1 / max(n1, 1)
    return max(0.0, t0 - slope * n0), slope


def fit_allreduce(ranks: int, nbytes: list[float], times: list[float]) -> Fit:
    """Ring allreduce ``times`` (s) of ``nbytes`` on ``ranks`` fitted to ``t = 2(n-1) a +
    2(n-1)/n X / w``: the link rate ``w`` (bytes/s) from the least-squares slope over all
    sizes, the hop latency ``a`` (clipped at 0) from the smallest size's time less its
    byte term. Not the intercept: the largest sizes, whose noise is milliseconds, have the
    most leverage on it.

    Raises:
        ValueError: fewer than two sizes.
        HexagramError: the times do not grow with the size (the byte term is lost in the
            noise: measure larger sizes, or on a quieter machine).

    Example:
        >>> f = fit_allreduce(4, [0.0, 8e6], [6e-3, 6e-3 + 1.5 * 8e6 / 1e9])
        >>> round(f.latency_s * 1e6), round(f.rate_bps * 8 / 1e9, 3)
        (1000, 8.0)
    """
    if len(nbytes) != len(times) or len(set(nbytes)) < 2:
        raise ValueError(f"fit_allreduce needs times at two sizes or more, got sizes "
                         f"{nbytes} and {len(times)} times")
    slope, _ = statistics.linear_regression(nbytes, times)
    if slope <= 0:
        raise HexagramError(f"allreduce times {[round(t * 1e3, 3) for t in times]} ms do not "
                            f"grow with the sizes {nbytes} bytes: the bandwidth cannot be "
                            f"fitted; measure larger sizes or on a quieter machine")
    rate = 2 * (ranks - 1) / ranks / slope
    small = min(range(len(nbytes)), key=lambda i: nbytes[i])
    alpha = max(0.0, times[small] - nbytes[small] * slope) / (2 * (ranks - 1))
    return Fit(alpha, rate)
