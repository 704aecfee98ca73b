"""The cross-mesh slice map on its own (pure): for many tensor shapes and pairs of stage
meshes, every destination element comes from exactly one source piece (once per source dp
index for summands), every piece lies inside what its source holds and what its destination
needs, no destination receives more than its own part, and the sends spread over replicas.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hexagram.errors import HexagramError
from hexagram.parallel.crossmesh import MeshLayout, slice_map

SHAPES = [(12, 6), (12, 3, 6), (24, 12), (6, 2, 2, 12)]
MESHES = [(1, 1), (2, 1), (1, 2), (3, 1), (2, 2), (1, 3), (3, 2), (2, 3), (6, 1), (1, 6)]


def _layouts(first: int) -> list[MeshLayout]:
    out = []
    for (dp, tp), batch, feature in itertools.product(MESHES, (True, False), (True, False)):
        ranks = tuple(range(first, first + dp * tp))
        out.append(MeshLayout(ranks=ranks, dp=dp, tp=tp, batch=batch, feature=feature))
    return out


def _inside(inner: tuple, outer: tuple) -> bool:
    return all(o0 <= i0 < i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer))


def _cover(shape: tuple, src: MeshLayout, dst: MeshLayout) -> dict[int, np.ndarray]:
    """Per destination rank, how many pieces cover each element of its part."""
    counts = {r: np.zeros(shape, dtype=np.int64) for r in dst.ranks}
    for piece in slice_map(shape, src, dst):
        assert _inside(piece.box, src.box(shape, piece.src))      # the source holds it
        assert _inside(piece.box, dst.box(shape, piece.dst))      # the destination needs it
        counts[piece.dst][tuple(slice(a, b) for a, b in piece.box)] += 1
    return counts


def _needed(shape: tuple, dst: MeshLayout, rank: int) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    mask[tuple(slice(a, b) for a, b in dst.box(shape, rank))] = True
    return mask


@pytest.mark.parametrize("shape", SHAPES)
def test_every_destination_element_is_covered_exactly_once(shape: tuple) -> None:
    for src, dst in itertools.product(_layouts(0), _layouts(100)):
        for rank, count in _cover(shape, src, dst).items():
            need = _needed(shape, dst, rank)
            assert (count[need] == 1).all(), (shape, src, dst, rank)
            assert (count[~need] == 0).all()  # never more than its own part (no gather)


@pytest.mark.parametrize("shape", SHAPES)
def test_summands_cover_each_element_once_per_source_dp_index(shape: tuple) -> None:
    for (dp, tp), dst in itertools.product(MESHES, _layouts(100)):
        src = MeshLayout(ranks=tuple(range(dp * tp)), dp=dp, tp=tp, batch=False,
                         partial=True)
        for rank, count in _cover(shape, src, dst).items():
            assert (count[_needed(shape, dst, rank)] == dp).all()
        # each summand (source dp index) is read once per destination element
        pieces = slice_map(shape, src, dst)
        assert {p.src // tp for p in pieces} == set(range(dp))


def test_replicas_take_turns_as_senders() -> None:
    # 2 dp ranks x 2 replicas each (tp=2) send to 4 destinations: every source rank sends
    src = MeshLayout(ranks=(0, 1, 2, 3), dp=2, tp=2)
    dst = MeshLayout(ranks=(4, 5, 6, 7), dp=4, tp=1)
    assert {p.src for p in slice_map((8, 4), src, dst)} == {0, 1, 2, 3}


def test_same_layout_moves_nothing_between_ranks() -> None:
    a = MeshLayout(ranks=(0, 1, 2, 3), dp=2, tp=2, feature=True)
    assert all(p.src == p.dst for p in slice_map((4, 8), a, a))


def test_uneven_split_and_bad_meshes_are_refused_with_the_fix() -> None:
    src = MeshLayout(ranks=(0, 1, 2), dp=3, tp=1)
    with pytest.raises(HexagramError, match="does not split evenly over dp=3"):
        slice_map((8, 4), src, MeshLayout(ranks=(3,), dp=1, tp=1))
    with pytest.raises(HexagramError, match="give dp \\* tp ranks"):
        MeshLayout(ranks=(0, 1), dp=2, tp=2)
    with pytest.raises(HexagramError, match="use batch=False"):
        MeshLayout(ranks=(0,), dp=1, tp=1, partial=True)
