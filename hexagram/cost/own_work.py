"""CPU an algorithm spends outside its compressor, timed on the job's own shapes.

The compressor's encode and decode (:func:`hexagram.cost.profile.measure_compressor`) are
not all the CPU of every algorithm. gTop-k's tree (:mod:`hexagram.comm.gtopk`) sorts this
rank's ``k`` pairs by index, then in each of its ``ceil(log2 P)`` rounds packs them, unpacks
the partner's, merges the two sparse sets (a stable sort of ``2k`` indices, the sums of
shared ones, a top-k of the union) and checks which of its own pairs survived; finally the
result is written into the segment. On the lab's 6.3M MLP that is about 0.1 CPU seconds a
step and rank (4 ranks, one thread), where the model had counted 3 decodes of the payload.

:func:`gtopk_tree_cost` runs those very functions (``merge_topk`` and the helpers the
collective calls) on two of the job's tensor shapes, with the algorithm's own compressor
making the pairs, and fits ``a + b n`` per segment of ``n`` elements
(:class:`~hexagram.cost.profile.TreeCost`). Only local work is timed: the partner's pairs
come from a second random tensor, as a partner's would.

Example:
    >>> import hexagram as hx
    >>> cost = gtopk_tree_cost(hx.algorithms.get("gtopk"), ((64, 64), (256, 256)))
    >>> cost.seconds(65536, 2) > cost.seconds(4096, 2) > 0
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from hexagram.algorithms.base import Algorithm
from hexagram.cost.profile import TreeCost, device_clock

__all__ = ["OWN_WORK", "gtopk_tree_cost"]

Shapes = tuple[tuple[int, ...], tuple[int, ...]]


def _best(fn: Callable[[], Any], reps: int, clock: Callable[[], float]) -> tuple[float, Any]:
    """(fastest of ``reps`` runs of ``fn`` on ``clock``, its last result)."""
    best, out = math.inf, None
    for _ in range(reps):
        t0 = clock()
        out = fn()
        best = min(best, clock() - t0)
    return best, out


def _pairs(comp: Any, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    from hexagram.algorithms.gtopk import sparse_pairs

    return sparse_pairs(comp.compress(torch.randn(n, generator=gen), gen))


def _segment_times(algorithm: Algorithm, n: int, reps: int,
                   clock: Callable[[], float]) -> tuple[float, float]:
    """(once, one round) CPU seconds of gTop-k's own work on a segment of ``n`` elements."""
    from hexagram.comm.gtopk import _isin, _pack, _sort_pairs, _unpack, merge_topk

    gen = torch.Generator().manual_seed(0)
    comp = algorithm.compressor  # type: ignore[attr-defined]
    values, indices = _pairs(comp, n, gen)
    k = values.numel()
    theirs_v, theirs_i, _ = _sort_pairs(*_pairs(comp, n, gen))
    sort_s, (v, i, _) = _best(lambda: _sort_pairs(values.clone(), indices.clone()), reps,
                              clock)
    pack_s, buf = _best(lambda: _pack(v, i), reps, clock)
    unpack_s, _ = _best(lambda: _unpack(buf, k, v.dtype), reps, clock)
    merge_s, (gv, gi) = _best(lambda: merge_topk(v, i, theirs_v, theirs_i, k), reps, clock)
    check_s, _ = _best(lambda: _isin(i, gi), reps, clock)
    out = torch.empty(n)
    write_s, _ = _best(lambda: out.zero_().index_put_((gi,), gv / 2), reps, clock)
    return sort_s + write_s, pack_s + unpack_s + merge_s + check_s


def gtopk_tree_cost(algorithm: Algorithm, sizes: Shapes, reps: int = 2,
                    device: torch.device | str = "cpu") -> TreeCost:
    """gTop-k's own tree work (module doc) timed at the two ``sizes`` (element counts
    taken from the shapes), best of ``reps``, fitted to ``a + b n`` per part; CPU seconds
    of this thread (:func:`~hexagram.cost.profile.device_clock`)."""
    clock = device_clock(device)
    (n0, n1) = (max(2, math.prod(s)) for s in sizes)
    (o0, r0), (o1, r1) = (_segment_times(algorithm, n, reps, clock) for n in (n0, n1))
    return TreeCost(_line(n0, o0, n1, o1), _line(n0, r0, n1, r1))


def _line(n0: int, t0: float, n1: int, t1: float) -> tuple[float, float]:
    """``(a, b)`` through two points, neither negative."""
    slope = max(0.0, (t1 - t0) / (n1 - n0)) if n1 != n0 else t1 / max(n1, 1)
    return max(0.0, t0 - slope * n0), slope


#: algorithms with CPU of their own outside the compressor, and how it is timed
OWN_WORK: dict[str, Callable[[Algorithm, Shapes], TreeCost]] = {"gtopk": gtopk_tree_cost}
