"""Cross-mesh resharding (Alpa): move a tensor between two stage meshes of any dp x tp shape.

A tensor that crosses a pipeline boundary lies on the source stage's ``dp x tp`` mesh and is
needed on the destination stage's mesh, each with its own :class:`MeshLayout`: dim 0 split
over ``dp`` (the batch) or replicated, the last dim split over ``tp`` or replicated.
:func:`slice_map` is the pure plan of the move: for every destination rank, the boxes it
needs and, for each, one source rank that holds it (replicas take turns, so the sends spread
over the source ranks). Every destination element comes from exactly one piece; no rank
ever holds more than its own part (no gather). :func:`exchange` runs the map with
point-to-point ``batch_isend_irecv`` on the default group (gloo and NCCL).

``partial=True`` on a source layout says its ``dp`` ranks hold summands, not replicas
(gradients of a tensor every rank of the next stage used whole): each destination element
then gets one piece per source ``dp`` index, which :func:`exchange` adds up.

Example:
    >>> src = MeshLayout(ranks=(0, 1), dp=2, tp=1)            # batch split over 2 ranks
    >>> dst = MeshLayout(ranks=(2, 3), dp=1, tp=2)            # replicated over tp=2
    >>> [(p.src, p.dst, p.box[0]) for p in slice_map((4, 3), src, dst)]  # rows each gets
    [(0, 2, (0, 2)), (1, 2, (2, 4)), (0, 3, (0, 2)), (1, 3, (2, 4))]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from hexagram.errors import HexagramError

__all__ = ["MeshLayout", "Piece", "exchange", "slice_map"]

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class MeshLayout:
    """How a tensor lies on a stage mesh.

    Attributes:
        ranks: global ranks, dp-major (``ranks[d * tp + t]``), as in a StagePlan.
        dp, tp: the mesh shape.
        batch: dim 0 is split over ``dp`` (else every dp index holds it whole).
        feature: the last dim is split over ``tp`` (else the tp ranks hold replicas).
        partial: the dp indices hold summands of the tensor (only with ``batch=False``).
    """

    ranks: tuple[int, ...]
    dp: int
    tp: int
    batch: bool = True
    feature: bool = False
    partial: bool = False

    def __post_init__(self) -> None:
        if len(self.ranks) != self.dp * self.tp:
            raise HexagramError(f"MeshLayout has {len(self.ranks)} ranks but dp x tp = "
                                f"{self.dp} x {self.tp}: give dp * tp ranks")
        if self.partial and self.batch:
            raise HexagramError("MeshLayout(partial=True) sums over dp: use batch=False")

    def blocks(self, shape: Sequence[int]) -> tuple[int, int]:
        """(distinct dp blocks, distinct tp blocks) of a tensor of ``shape``."""
        nd, nt = (self.dp if self.batch else 1), (self.tp if self.feature else 1)
        for dim, parts, what in ((0, nd, "dp"), (len(shape) - 1, nt, "tp")):
            if parts > 1 and (not shape or shape[dim] % parts):
                raise HexagramError(f"a tensor of shape {tuple(shape)} crossing stages does "
                                    f"not split evenly over {what}={parts} on dim {dim}: "
                                    f"plan a batch (or width) divisible by it")
        return nd, nt

    def block_box(self, shape: Sequence[int], d: int, t: int) -> Box:
        """The box of dp block ``d`` and tp block ``t`` (see :meth:`blocks`)."""
        nd, nt = self.blocks(shape)
        box = [(0, n) for n in shape]
        if nd > 1:
            step = shape[0] // nd
            box[0] = (d * step, (d + 1) * step)
        if nt > 1:
            step = shape[-1] // nt
            box[-1] = (t * step, (t + 1) * step)
        return tuple(box)

    def box(self, shape: Sequence[int], rank: int) -> Box:
        """The part of the tensor ``rank`` holds."""
        i = self.ranks.index(rank)
        d, t = divmod(i, self.tp)
        return self.block_box(shape, d if self.batch else 0, t if self.feature else 0)


class Piece(NamedTuple):
    """``src`` sends ``dst`` the box ``box`` (global coordinates) of the tensor."""

    src: int
    dst: int
    box: Box


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _holder(src: MeshLayout, d: int, t: int, turn: int) -> int:
    """One source rank holding block (d, t): replicas take turns by ``turn``."""
    ds = [d] if (src.batch or src.partial) else list(range(src.dp))
    ts = [t] if src.feature else list(range(src.tp))
    holders = [src.ranks[a * src.tp + b] for a in ds for b in ts]
    return holders[turn % len(holders)]


def slice_map(shape: Sequence[int], src: MeshLayout, dst: MeshLayout) -> list[Piece]:
    """Pieces moving a tensor of global ``shape`` from ``src`` to ``dst`` (pure).

    Grouped by destination rank (in ``dst.ranks`` order); within one (src, dst) pair the
    order is fixed, so both sides of a send agree on it. Source blocks partition the tensor
    (summands: one partition per dp index), hence each destination element is covered once
    (once per source dp index when ``src.partial``). Pieces with ``src == dst`` are local.
    """
    return list(_pieces(tuple(int(n) for n in shape), src, dst))


@functools.lru_cache(maxsize=1024)
def _pieces(shape: tuple[int, ...], src: MeshLayout, dst: MeshLayout) -> tuple[Piece, ...]:
    """:func:`slice_map`, memoised: a pipeline asks for the same few maps every
    micro-batch of every step (the layouts are frozen, so hashable)."""
    nd, nt = src.blocks(shape)
    n_sum = src.dp if src.partial else 1
    out = []
    for turn, rank in enumerate(dst.ranks):
        want = dst.box(shape, rank)
        for d in range(max(nd, n_sum)):
            for t in range(nt):
                part = _intersect(want, src.block_box(shape, d if nd > 1 else 0, t))
                if part is not None:
                    out.append(Piece(_holder(src, d, t, turn), rank, part))
    return tuple(out)


def _local(box: Box, within: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, within))


def _size(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


@dataclass
class _Move:
    """One tensor of an :func:`exchange`: what I hold (None if not a source) and where to."""

    tensor: torch.Tensor | None
    shape: tuple[int, ...]
    src: MeshLayout
    dst: MeshLayout
    out: torch.Tensor | None = None


def _plan_ops(moves: list[_Move], me: int, dtype: list[torch.dtype],
              device: torch.device) -> tuple[list[dist.P2POp], list[tuple[int, Piece,
                                                                           torch.Tensor]]]:
    ops, received = [], []
    for k, mv in enumerate(moves):
        for piece in slice_map(mv.shape, mv.src, mv.dst):
            if piece.src == me and piece.dst != me:
                assert mv.tensor is not None
                part = mv.tensor[_local(piece.box, mv.src.box(mv.shape, me))].contiguous()
                ops.append(dist.P2POp(dist.isend, part, piece.dst))
            elif piece.dst == me:
                if piece.src == me:
                    assert mv.tensor is not None
                    buf = mv.tensor[_local(piece.box, mv.src.box(mv.shape, me))]
                else:
                    buf = torch.empty(_size(piece.box), dtype=dtype[k], device=device)
                    ops.append(dist.P2POp(dist.irecv, buf, piece.src))
                received.append((k, piece, buf))
    return ops, received


def exchange(tensors: Sequence[torch.Tensor | None], shapes: Sequence[Sequence[int]],
             dtypes: Sequence[torch.dtype], src: Sequence[MeshLayout],
             dst: Sequence[MeshLayout], device: torch.device,
             pending: list[tuple[list[dist.Work], list[dist.P2POp]]] | None = None
             ) -> list[torch.Tensor | None]:
    """Reshard several tensors at once (one ``batch_isend_irecv``); every rank of either
    mesh calls it with the same shapes and layouts. ``tensors[k]``: this rank's part of
    tensor ``k`` (None where it is not a source). Returns this rank's part of each tensor
    on its destination mesh (None where it is not a destination); summands are added.
    ``pending``: a rank that only sends appends its requests (and the ops, which keep the
    send buffers alive) there instead of waiting; the caller waits them later, e.g. at the
    end of a pipeline step."""
    me = dist.get_rank()
    moves = [_Move(t, tuple(int(n) for n in s), a, b)
             for t, s, a, b in zip(tensors, shapes, src, dst)]
    ops, received = _plan_ops(moves, me, list(dtypes), device)
    if ops:
        works = dist.batch_isend_irecv(ops)
        if pending is not None and all(op.op is dist.isend for op in ops):
            pending.append((works, ops))
        else:
            for work in works:
                work.wait()
    for k, mv in enumerate(moves):
        if me in mv.dst.ranks:
            mv.out = torch.zeros(_size(mv.dst.box(mv.shape, me)), dtype=dtypes[k],
                                 device=device)
    for k, piece, buf in received:
        out, mv = moves[k].out, moves[k]
        assert out is not None
        where = _local(piece.box, mv.dst.box(mv.shape, me))
        if mv.src.partial:
            out[where] += buf
        else:
            out[where].copy_(buf)
    return [mv.out for mv in moves]
