"""Test-retest of two lab runs (harness.retest), by hand."""

from __future__ import annotations

import pytest
from harness.retest import compare, markdown, spearman, tie_groups, tied_spearman


def report(setting: str, cells: dict[str, tuple[float, float]]) -> dict[str, object]:
    """One setting, one workload (mlp): {algorithm: (measured, predicted)}."""
    return {"settings": [{"bandwidth": setting, "models": {"mlp": {"cells": [
        {"algorithm": n, "measured_s": m, "predicted_s": q, "error": None}
        for n, (m, q) in cells.items()]}}}]}


def test_spearman_by_hand() -> None:
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # ranks 0 1 2 3 vs 0 2 1 3: d^2 = 2, 1 - 6 * 2 / (4 * 15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert spearman([1, 1, 1], [1, 2, 3]) == 1.0  # a constant side: no order to miss


def test_retest_spread_and_spearmans_by_hand() -> None:
    a = report("1gbit", {"x": (1.00, 1.0), "y": (1.02, 2.0), "z": (2.00, 3.0),
                         "w": (4.0, 4.0)})
    b = report("1gbit", {"x": (1.03, 1.0), "y": (1.00, 2.0), "z": (2.10, 3.0),
                         "only_b": (9.0, 9.0)})
    [row] = compare(a, b)
    assert (row["setting"], row["workload"], row["cells"]) == ("1gbit", "mlp", 3)
    # measured orders x<y<z and y<x<z: ranks (0,1,2) vs (1,0,2): 1 - 6*2/(3*8) = 0.5
    assert row["retest_spearman"] == pytest.approx(0.5)
    # |b/a - 1|: 0.03, 0.0196, 0.05 -> median 0.03
    assert row["median_abs_diff"] == pytest.approx(0.03)
    assert row["model_spearman_a"] == pytest.approx(1.0)
    assert row["model_spearman_b"] == pytest.approx(0.5)
    # within 3 %: 1.00 and 1.03 tie in b, so the model's order costs nothing there
    assert row["model_spearman_b_tied"] == pytest.approx(0.866, abs=1e-3)
    assert "0.50" in markdown([row], "cvf", "cv13")


def test_tie_groups_chain_from_the_group_start() -> None:
    # 1.00, 1.04, 1.08: 1.08 is 8 % above the group's start, a new group at 5 %
    assert tie_groups([1.08, 1.00, 1.04], 0.05) == [1, 0, 0]
    assert tie_groups([1.0, 2.0], 0.0) == [0, 1]
    assert tied_spearman([1, 2], [2.0, 1.0], 0.0) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="spread"):
        tie_groups([1.0], -0.1)


def test_no_common_cells_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="share no setting"):
        compare(report("1gbit", {"x": (1.0, 1.0), "y": (2.0, 2.0)}),
                report("unshaped", {"x": (1.0, 1.0), "y": (2.0, 2.0)}))


def test_cells_of_another_configuration_are_left_out() -> None:
    a = report("1gbit", {"x": (1.0, 1.0), "y": (2.0, 2.0), "z": (3.0, 3.0)})
    b = report("1gbit", {"x": (1.0, 1.0), "y": (2.0, 2.0), "z": (0.5, 3.0)})
    a["settings"][0]["models"]["mlp"]["cells"][2]["config"] = {"block": 0}  # type: ignore[index]
    [row] = compare(a, b)
    assert (row["cells"], row["other_config"], row["retest_spearman"]) == (2, ["z"], 1.0)
