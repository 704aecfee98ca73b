"""Layer-wise PowerSGD over a whole bucket: matrices of one shape as one batch.

:class:`hexagram.algorithms.powersgd.PowerSGDAlgorithm` with ``granularity="layer"``
compresses every weight matrix of a bucket on its own. Done matrix by matrix that is a
dozen kernels per matrix (residual, P, QR, Q, P Q^T, residual again); a bucket's matrices
have a handful of shapes (a transformer block repeats the same ones), so here each shape is
one batch ``(g, rows, cols)``: one ``bmm`` for its P's, one batched QR, one ``bmm`` for its
Q's, one batched P Q^T, and the error feedback of the whole bucket is one buffer
(:meth:`hexagram.compress.ErrorFeedback.bind_flat`) laid out batch by batch. The
vectors (biases) and the matrices that would not shrink go uncompressed in P's allreduce,
gathered and scattered back through one index each. The values are those of compressing
each matrix alone (the same products, the same QR per matrix).

The warm-start Q of each matrix stays the compressor's per-name entry (checkpoints and a
new bucket layout see it): it is a view of its batch's ``(g, cols, r)`` buffer.

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("powersgd", granularity="layer").config.granularity
    'layer'
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from hexagram.buckets import Bucket, BucketEntry
from hexagram.compress.chunks import work_dtype
from hexagram.compress.feedback import ErrorFeedback
from hexagram.compress.lowrank import PowerSGDCompressor, matrix_shape
from hexagram.compress.segments import Segments

__all__ = ["Batch", "LayerLayout", "Stage", "worth_compressing"]


@dataclass(eq=False)
class Batch:
    """The matrices of one shape in a bucket: entry indices ``members``, (rows, cols)."""

    members: tuple[int, ...]
    names: tuple[str, ...]
    rows: int
    cols: int
    rank: int
    q: Tensor | None = None  # (g, cols, r): the warm starts, views registered per name
    q_version: int = -1


def worth_compressing(shape: torch.Size, compressor: PowerSGDCompressor,
                      min_rate: float = 1.0) -> bool:
    """True when the factors of a tensor of ``shape``, ``min_rate`` times over, are smaller
    than the tensor (PyTorch's ``_should_compress``); ``min_rate=1`` is
    :meth:`PowerSGDCompressor.worthwhile`."""
    rows, cols = matrix_shape(shape)
    return compressor.worthwhile(shape) \
        and (rows + cols) * compressor.effective_rank(shape) * min_rate < shape.numel()


@dataclass(eq=False)
class LayerLayout:
    """Batches and uncompressed entries of one bucket layout (built once per layout)."""

    entries: list[BucketEntry]
    segments: Segments
    batches: list[Batch]
    dense: tuple[int, ...]  # entry indices sent uncompressed
    keys: tuple[str, ...] = field(init=False)  # error-feedback keys, batch by batch
    lengths: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.keys = tuple(n for b in self.batches for n in b.names)
        self.lengths = tuple(b.rows * b.cols for b in self.batches for _ in b.members)

    @classmethod
    def of(cls, bucket: Bucket, compressor: PowerSGDCompressor,
           min_rate: float = 1.0) -> LayerLayout:
        by_shape: dict[tuple[int, int], list[int]] = {}
        dense = []
        for i, e in enumerate(bucket.entries):
            if len(e.shape) < 2 or e.numel == 0 \
                    or not worth_compressing(e.shape, compressor, min_rate):
                dense.append(i)
            else:
                by_shape.setdefault(matrix_shape(e.shape), []).append(i)
        batches = [Batch(tuple(m), tuple(bucket.entries[i].name for i in m), rows, cols,
                         min(compressor.config.rank, rows, cols))
                   for (rows, cols), m in by_shape.items()]
        lengths = [max(1, e.numel) for e in bucket.entries]
        return cls(bucket.entries, Segments.of(lengths), batches, tuple(dense))

    def dense_index(self, device: torch.device) -> Tensor:
        """(D,) int64: the bucket positions of the uncompressed entries (cached)."""
        def make() -> Tensor:
            parts = [torch.arange(e.offset, e.offset + e.numel) for e in
                     (self.entries[i] for i in self.dense)]
            return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)).to(device)
        return self.segments.cached("dense", device, make)

    def gather_index(self, batch: Batch, device: torch.device) -> Tensor:
        """(g * n,) int64: the bucket positions of ``batch``'s matrices, row by row."""
        seg = self.segments
        return seg.cached(("gather", batch.members), device, lambda: torch.cat([
            torch.arange(seg.offsets[i], seg.offsets[i] + seg.lengths[i])
            for i in batch.members]).to(device))


@dataclass(eq=False)
class Stage:
    """One bucket's step in flight: each batch's M (g, rows, cols) and P, where M lives."""

    layout: LayerLayout
    ms: list[Tensor]
    ps: list[Tensor]
    in_place: list[bool]  # M is the bucket's own memory (write P Q^T straight there)
    residual: Tensor | None  # the error feedback buffer, batch by batch


def warm_starts(batch: Batch, compressor: PowerSGDCompressor, like: Tensor) -> Tensor:
    """``batch``'s (g, cols, r) Q: its buffer while the compressor still holds its views,
    else rebuilt from the per-name warm starts (or each name's seeded initial Q)."""
    if batch.q is not None and batch.q_version == compressor.q_version \
            and batch.q.dtype == like.dtype and batch.q.device == like.device:
        return batch.q
    qs = []
    for name in batch.names:
        q = compressor.warm_start(name)
        if q is None or q.shape != (batch.cols, batch.rank) or q.dtype != like.dtype \
                or not compressor.config.warm_start:
            q = compressor.initial_q(name, batch.cols, batch.rank, like)
        qs.append(q)
    batch.q = torch.stack(qs)
    for name, view in zip(batch.names, batch.q):
        compressor.bind_warm_start(name, view)
    batch.q_version = compressor.q_version
    return batch.q


def first_stage(layout: LayerLayout, flat: Tensor, compressor: PowerSGDCompressor,
                ef: ErrorFeedback | None) -> tuple[Stage, Tensor]:
    """Residuals added, each batch's P = M Q (Q orthonormalized: one batched QR); returns
    the stage and P's allreduce buffer (every P, then the uncompressed entries, in the
    work dtype)."""
    work = work_dtype(flat.dtype)
    residual = None if ef is None else \
        ef.bind_flat(layout, layout.keys, layout.lengths, flat).buffer
    ms, ps, in_place, offset = [], [], [], 0
    for b in layout.batches:
        rows = layout.segments.rows(flat, b.members)
        own = rows.dtype == work and rows.untyped_storage().data_ptr() == \
            flat.untyped_storage().data_ptr()
        m = rows if own else rows.to(work)
        if residual is not None:
            m.add_(residual[offset:offset + m.numel()].view_as(m))
        m = m.view(len(b.members), b.rows, b.cols)
        # Q's columns orthonormalized first, as PyTorch's hook (PowerSGDCompressor.compute_p)
        q = compressor.orthonormal(warm_starts(b, compressor, m))
        ps.append(torch.bmm(m, q))
        ms.append(m)
        in_place.append(own)
        offset += m.numel()
    dense = flat.index_select(0, layout.dense_index(flat.device)).to(work)
    buffer = torch.cat([p.reshape(-1) for p in ps] + [dense])
    return Stage(layout, ms, ps, in_place, residual), buffer


def second_stage(stage: Stage, first: Tensor, compressor: PowerSGDCompressor) -> Tensor:
    """Each batch's averaged P orthogonalized (in place in ``first``), then Q = M^T P;
    returns Q's allreduce buffer."""
    qs = []
    offset = 0
    for m, p in zip(stage.ms, stage.ps):
        mean_p = first[offset:offset + p.numel()].view_as(p)
        compressor.orthogonalize(mean_p)
        qs.append(torch.bmm(mean_p.transpose(1, 2), m).transpose(1, 2).reshape(-1))
        offset += p.numel()
    return torch.cat(qs) if qs else first.new_zeros(0)


def write(stage: Stage, flat: Tensor, first: Tensor, second: Tensor,
          compressor: PowerSGDCompressor) -> Tensor:
    """Warm starts := the averaged Q's; each matrix := P Q^T (residual := M - P Q^T);
    the uncompressed entries := their means. Returns ``flat``."""
    lay, p_at, q_at, r_at = stage.layout, 0, 0, 0
    for b, m, p, own in zip(lay.batches, stage.ms, stage.ps, stage.in_place):
        mean_p = first[p_at:p_at + p.numel()].view_as(p)
        q = second[q_at:q_at + b.cols * b.rank * len(b.members)].view(-1, b.cols, b.rank)
        p_at, q_at = p_at + p.numel(), q_at + q.numel()
        if compressor.config.warm_start:
            assert b.q is not None
            b.q.copy_(q)
        res = None if stage.residual is None else \
            stage.residual[r_at:r_at + m.numel()].view_as(m)
        r_at += m.numel()
        if own:  # M is the bucket: save it as the residual, write P Q^T, subtract
            if res is not None:
                res.copy_(m)
            product_into(mean_p, q, m)
            if res is not None:
                res.sub_(m)
            continue
        approx = product_into(mean_p, q, torch.empty_like(m))
        if res is not None:
            torch.sub(m, approx, out=res)
        flat.index_copy_(0, lay.gather_index(b, flat.device), approx.view(-1).to(flat.dtype))
    dense = lay.dense_index(flat.device)
    flat.index_copy_(0, dense, first[p_at:].to(flat.dtype))
    return flat


def product_into(p: Tensor, q: Tensor, out: Tensor) -> Tensor:
    """``out`` (g, rows, cols) := P Q^T per matrix (P (g, rows, r), Q (g, cols, r)): up
    to rank 2 as broadcast products, as
    :meth:`~hexagram.compress.lowrank.PowerSGDCompressor.product_into` (same bits)."""
    qt = q.transpose(1, 2).contiguous()
    if p.shape[2] > 2:
        return torch.bmm(p, qt, out=out)
    torch.mul(p[:, :, :1], qt[:, :1], out=out)
    if p.shape[2] == 2:
        out.addcmul_(p[:, :, 1:], qt[:, 1:])
    return out
