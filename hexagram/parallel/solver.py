"""A small MILP front end: HiGHS (highspy, in memory) with PuLP's CBC as the fallback.

Problem: minimise ``c @ x`` subject to ``lo <= A x <= hi`` (rows given sparsely) with
``0 <= x <= 1`` and the first ``n_binary`` variables binary.

Example:
    >>> # pick one of two items, the cheaper
    >>> solve([3.0, 1.0], [({0: 1.0, 1: 1.0}, 1.0, 1.0)], n_binary=2)
    [0.0, 1.0]
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from hexagram.errors import require

__all__ = ["Row", "solve"]

#: one constraint: ({variable: coefficient}, lower bound, upper bound)
Row = tuple[dict[int, float], float, float]

_FEATURE = "the planner's ILP (hexagram plan, hexagram.parallel)"


def _quiet_highs(highspy: Any) -> Any:
    """A ``Highs`` instance without its banner: HiGHS prints "Running HiGHS ..." to the C
    stdout when it is constructed, before any option can turn logging off, so the process's
    file descriptor 1 points at /dev/null for that call (C buffers flushed before it is
    restored, so nothing leaks out later)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all: nothing to keep clean
        return highspy.Highs()
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        try:
            return highspy.Highs()
        finally:
            ctypes.CDLL(None).fflush(None)
            os.dup2(saved, 1)
    finally:
        os.close(null)
        os.close(saved)


def _solve_highs(c: Sequence[float], rows: Sequence[Row], n_binary: int) -> list[float] | None:
    import numpy as np

    highspy = require("highspy", extra="planner", feature=_FEATURE)

    h = _quiet_highs(highspy)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("log_to_console", False)
    h.setOptionValue("mip_rel_gap", 1e-6)
    n = len(c)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, len(rows)
    lp.col_cost_ = np.asarray(c, dtype=np.float64)
    lp.col_lower_, lp.col_upper_ = np.zeros(n), np.ones(n)
    lp.row_lower_ = np.array([r[1] for r in rows], dtype=np.float64)
    lp.row_upper_ = np.array([r[2] for r in rows], dtype=np.float64)
    starts, index, value = [0], [], []
    for coeffs, _lo, _hi in rows:
        index += list(coeffs)
        value += list(coeffs.values())
        starts.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(value, dtype=np.float64)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n_binary + \
        [highspy.HighsVarType.kContinuous] * (n - n_binary)
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return [float(v) for v in h.getSolution().col_value]


def _solve_pulp(c: Sequence[float], rows: Sequence[Row], n_binary: int) -> list[float] | None:
    pulp = require("pulp", extra="planner", feature=_FEATURE)
    prob = pulp.LpProblem("hexagram_ilp", pulp.LpMinimize)
    xs = [pulp.LpVariable(f"x{i}", 0, 1, cat="Binary" if i < n_binary else "Continuous")
          for i in range(len(c))]
    prob += pulp.lpSum(ci * x for ci, x in zip(c, xs))
    for coeffs, lo, hi in rows:
        expr = pulp.lpSum(v * xs[i] for i, v in coeffs.items())
        if lo == hi:
            prob += expr == lo
        else:
            if math.isfinite(lo):
                prob += expr >= lo
            if math.isfinite(hi):
                prob += expr <= hi
    status = prob.solve(pulp.PULP_CBC_CMD(msg=False))
    if pulp.LpStatus[status] != "Optimal":
        return None
    return [float(x.value() or 0.0) for x in xs]


def solve(c: Sequence[float], rows: Sequence[Row], n_binary: int) -> list[float] | None:
    """Optimal ``x`` or ``None`` when infeasible (HiGHS; CBC if highspy is missing; a
    :class:`~hexagram.errors.MissingExtraError` naming the ``planner`` extra if both are)."""
    try:
        return _solve_highs(c, rows, n_binary)
    except ImportError:
        return _solve_pulp(c, rows, n_binary)
