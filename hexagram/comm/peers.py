"""Peer selection for decentralized exchange: all, ring, shift_one, random.

Every function returns the group ranks this rank exchanges with at a given step. All
selections are symmetric (if i lists j, j lists i), so a send to each peer is matched by a
receive from it, and deterministic given (rank, size, step, seed): every rank computes the
same global pattern without communicating.

- ``all``: everyone else.
- ``ring``: left and right neighbours (one neighbour for size 2).
- ``shift_one``: one partner per step from a round-robin tournament (circle method), so over
  P-1 (P even) or P (P odd) steps each rank meets every other; with odd P one rank sits out.
- ``random``: a random perfect matching drawn from a seed shared by all ranks; with odd P one
  rank sits out.

Example:
    >>> select_peers("ring", rank=0, size=4, step=0)
    [3, 1]
    >>> [select_peers("shift_one", rank=0, size=4, step=s) for s in range(3)]
    [[3], [2], [1]]
"""

from __future__ import annotations

import random as _random
from typing import Literal

from hexagram.errors import ConfigError

__all__ = ["PEER_SELECTIONS", "PeerSelection", "select_peers"]

PeerSelection = Literal["all", "ring", "shift_one", "random"]
PEER_SELECTIONS: tuple[str, ...] = ("all", "ring", "shift_one", "random")


def _ring(rank: int, size: int) -> list[int]:
    if size == 1:
        return []
    left, right = (rank - 1) % size, (rank + 1) % size
    return [left] if left == right else [left, right]


def _round_robin_partner(rank: int, size: int, step: int) -> int | None:
    """Partner of ``rank`` in round ``step`` of the circle-method tournament."""
    n = size + (size % 2)  # add a dummy player for odd sizes; meeting it means sitting out
    rounds = n - 1
    r = step % rounds
    if rank == n - 1:
        partner = r
    else:
        partner = (2 * r - rank) % rounds
        if partner == rank:
            partner = n - 1
    return None if partner >= size else partner


def _random_partner(rank: int, size: int, step: int, seed: int) -> int | None:
    order = list(range(size))
    _random.Random(seed * 1_000_003 + step).shuffle(order)
    pos = order.index(rank)
    mate = pos ^ 1  # pairs (0,1), (2,3), ... of the shuffled order
    return order[mate] if mate < size else None


def select_peers(kind: str, rank: int, size: int, step: int = 0, seed: int = 0) -> list[int]:
    """Group ranks ``rank`` exchanges with at ``step`` (see module docstring)."""
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"rank {rank} must be in [0, size={size})")
    if kind == "all":
        return [r for r in range(size) if r != rank]
    if kind == "ring":
        return _ring(rank, size)
    if kind == "shift_one":
        p = _round_robin_partner(rank, size, step) if size > 1 else None
        return [] if p is None else [p]
    if kind == "random":
        p = _random_partner(rank, size, step, seed) if size > 1 else None
        return [] if p is None else [p]
    raise ConfigError(f"peers must be one of {list(PEER_SELECTIONS)}, got {kind!r}")
