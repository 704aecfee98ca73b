"""PowerSGD (Vogels et al. 2019): rank-r gradient approximation by one power iteration.

Per matrix ``M`` (n x m: a weight's gradient plus its error-feedback residual, viewed as
``shape[0]`` rows) and warm-started factor ``Q`` (m x r)::

    P = M orth(Q)    allreduce-mean P (n x r), then orthonormalize its columns
    Q = M^T P        allreduce-mean Q (m x r), kept for next step (warm start)
    approx = P Q^T   the update every rank applies; residual = M - approx

Both allreduces sum factors in full precision (they are linear in ``M``), each one message
per bucket through :func:`hexagram.comm.reduce.reduce`: the P stage also carries the
bucket's vectors (biases) and small matrices, which are sent uncompressed (they would not
shrink: ``r (n + m) >= n m``). The orthogonalization and the Q stage are chained on the P
allreduce's handle and run on a thread of their own with a process group of their own for
the Q allreduces, so later buckets' collectives never queue behind this compute and the
compute overlaps backward; P's of the same shape are orthogonalized by one batched QR.
The first ``start_iter`` steps are plain allreduce, as the paper's warm-up.

``orth(Q)``: the warm start's columns orthonormalized before ``P = M Q``, as PyTorch's
``powerSGD_hook`` does. The column space, hence the result in exact arithmetic, is the
same; but a warm start is ``M^T P`` of the last step, of the order of M's singular values,
so ``M Q`` from it is of the order of their squares: for a small gradient (singular values
near 1e-3) fp16's subnormals, where 16-bit factors on the wire keep a few bits (measured:
fp16 factors 100x further from float32 than PyTorch's fp16 hook; with ``orth``, no
further, ``tests/test_dropin_comm_hooks.py``).

With ``granularity="bucket"`` the whole bucket is one ``ceil(sqrt(N))``-row matrix (zero
padded): one pair of factors for the model instead of one per layer.

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("powersgd", rank=4).config.rank
    4
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from hexagram import compress
from hexagram.algorithms import powersgd_layers as layers
from hexagram.algorithms.base import AlgorithmContext
from hexagram.algorithms.compressed import CompressedAlgorithm, CompressedConfig, Segment, segments
from hexagram.buckets import Bucket, BucketEntry
from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.device import device_initializer
from hexagram.comm.reduce import reduce
from hexagram.comm.streams import on_stream, side_stream
from hexagram.compress.feedback import ErrorFeedback
from hexagram.compress.lowrank import PowerSGDCompressor
from hexagram.config import check_float, check_int

__all__ = ["PowerSGDAlgorithm", "PowerSGDAlgorithmConfig", "compressible", "segment_shape"]


@dataclass(frozen=True, kw_only=True)
class PowerSGDAlgorithmConfig(CompressedConfig):
    """Config of :class:`PowerSGDAlgorithm` (plus :class:`CompressedConfig`'s fields).

    Attributes:
        rank: r, columns of the factors; higher => closer to the true gradient, more bytes
            (r (n + m) floats per n x m matrix).
        start_iter: steps of plain allreduce before compressing (0 => compress at once).
        warm_start: reuse last step's Q (True, as the paper: one power iteration per step
            then converges over steps) or draw a fresh random Q every step.
        error_feedback: carry ``M - approx`` to the next step (needed for convergence).
        min_compression_rate: a tensor is compressed only when its factors, this many times
            over, are smaller than it (PyTorch's ``PowerSGDState`` knob, default 2 there);
            higher => fewer tensors compressed, more bytes; 1 => whenever the factors are
            smaller than the tensor.
    """

    algorithm = "powersgd"

    rank: int = 2
    start_iter: int = 10
    warm_start: bool = True
    error_feedback: bool = True
    min_compression_rate: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self, "rank", low=1, high=1 << 16)
        check_int(self, "start_iter", low=0)
        check_float(self, "min_compression_rate", low=1.0)


def segment_shape(segment: Segment, granularity: str) -> torch.Size:
    """Shape the compressor sees: the tensor's own (layer) or a flat vector (bucket)."""
    if granularity == "layer":
        return segment.entries[0].shape
    return torch.Size([segment.numel])


def compressible(shape: torch.Size, granularity: str, compressor: PowerSGDCompressor,
                 min_rate: float = 1.0) -> bool:
    """Layer-wise, vectors (biases) go uncompressed, as in the paper; any segment goes
    uncompressed when its factors (``min_rate`` times over) would not be smaller than
    itself."""
    if granularity == "layer" and len(shape) < 2:
        return False
    return layers.worth_compressing(shape, compressor, min_rate)


@dataclass
class _Matrix:
    segment: Segment
    key: str
    shape: torch.Size
    corrected: Tensor  # (numel,): gradient + residual
    m: Tensor  # (rows, cols): its matrix view, zero padded
    p: Tensor  # (rows, r) = M Q, this rank's


@dataclass(eq=False)  # compared by identity: the key of one bucket layout's residuals
class _BucketKey:
    entries: list[BucketEntry]


class PowerSGDAlgorithm(CompressedAlgorithm):
    """Rank-r PowerSGD with warm start and error feedback; see :class:`PowerSGDAlgorithmConfig`."""

    name = "powersgd"

    def __init__(self, config: PowerSGDAlgorithmConfig | None = None) -> None:
        super().__init__(config or PowerSGDAlgorithmConfig())
        self.config: PowerSGDAlgorithmConfig
        c = self.config
        # the compressor's step API: matrix, compute_p, orthogonalize, compute_q, store_q
        # (warm-start Q per key, initial Q seeded by key: the same on every rank)
        self.compressor = cast(PowerSGDCompressor, compress.get(
            "powersgd", rank=c.rank, warm_start=c.warm_start, seed=c.seed))
        self.compressor.checks_finite = False  # buckets are checked once per step instead
        if c.error_feedback:
            self.error_feedback = ErrorFeedback(self.compressor)
        self._layouts: dict[int, layers.LayerLayout] = {}  # bucket index -> its batches
        self._bucket_keys: dict[int, _BucketKey] = {}  # bucket index -> its residuals' key

    def setup(self, ctx: AlgorithmContext) -> None:
        """Over all ranks, the Q allreduces get a process group of their own (collective):
        stage 2 then runs on its own thread, overlapping backward, while P allreduces of
        later buckets go out on the main group; each group sees its collectives in bucket
        order on every rank. Over a subgroup (e.g. host leaders) stage 2 is chained lazily."""
        super().setup(ctx)
        self._q_comm = ctx.comm
        if 1 < ctx.comm.size == ctx.runtime.world_size:
            self._q_comm = Communicator(ctx.runtime.new_group("powersgd.q"), ctx.runtime.timeout,
                                        "powersgd-q", owns_group=True)
            # stage 2's thread sets its device first; its kernels run on a stream of their own
            self._stage2 = cf.ThreadPoolExecutor(
                1, thread_name_prefix="hexagram-powersgd",
                initializer=device_initializer(ctx.runtime.device))
            self._stage2_stream = side_stream(ctx.runtime.device)

    def reduce_bucket(self, bucket: Bucket) -> Handle[Tensor]:
        """Stage 1 now: P of every matrix and the dense segments in one allreduce (mean).
        Stage 2 chained on it: orthogonalize, Q, allreduce Q, write P Q^T and residuals."""
        comm = self.ctx.comm
        if self.step < self.config.start_iter:
            return reduce(comm, bucket.flat, out=bucket.flat)
        if self.config.granularity == "layer":  # matrices of one shape as one batch
            return self._reduce_layers(bucket)
        mats, dense = self._prepare(bucket)
        first = torch.cat([x.p.reshape(-1) for x in mats]
                          + [bucket.flat[s.start:s.stop].float() for s in dense])
        mean_p = _reduce_as(comm, first, bucket.dtype)
        return self._chain(mean_p, lambda p: self._second_stage(bucket, mats, dense, p))

    def _chain(self, mean_p: Handle[Tensor], then: Callable[[Tensor], Handle[Tensor]]
               ) -> Handle[Tensor]:
        """Stage 2 (``then`` of the averaged P's) chained on stage 1's allreduce: on its
        own thread and stream where the Q allreduces have a group of their own."""
        if self._q_comm is self.ctx.comm:
            return mean_p.then_wait(then)
        job = on_stream(self._stage2_stream,  # after this stream's P, Q and residual work
                        lambda: then(mean_p.wait()).wait())
        handle: Handle[Tensor] = Handle(self._stage2.submit(job), "powersgd.stage2",
                                        self._q_comm)
        handle.stream_job = job if self._stage2_stream is not None else None
        return handle

    def _reduce_layers(self, bucket: Bucket) -> Handle[Tensor]:
        """Layer-wise, batch by batch (:mod:`hexagram.algorithms.powersgd_layers`)."""
        layout = self._layouts.get(bucket.index)
        if layout is None or layout.entries is not bucket.entries:
            layout = self._layouts[bucket.index] = layers.LayerLayout.of(
                bucket, self.compressor, self.config.min_compression_rate)
        stage, first = layers.first_stage(layout, bucket.flat, self.compressor,
                                          self.error_feedback)

        def second(mean_p: Tensor) -> Handle[Tensor]:
            buf = layers.second_stage(stage, mean_p, self.compressor)
            return _reduce_as(self._q_comm, buf, bucket.dtype).then(
                lambda mean_q: layers.write(stage, bucket.flat, mean_p, mean_q,
                                            self.compressor))

        return self._chain(_reduce_as(self.ctx.comm, first, bucket.dtype), second)

    def _prepare(self, bucket: Bucket) -> tuple[list[_Matrix], list[Segment]]:
        mats: list[_Matrix] = []
        dense: list[Segment] = []
        for seg in segments(bucket, self.config.granularity):
            shape = segment_shape(seg, self.config.granularity)
            if not compressible(shape, self.config.granularity, self.compressor,
                                self.config.min_compression_rate):
                dense.append(seg)
                continue
            grad = bucket.flat[seg.start:seg.stop]
            # the residual is added in place: the bucket's buffer is not read after this
            corrected = grad if self.error_feedback is None \
                else grad.add_(self._residual(bucket))
            m = self.compressor.matrix(corrected.view(shape))
            key = "|".join(seg.names)
            mats.append(_Matrix(seg, key, shape, corrected, m, self.compressor.compute_p(key, m)))
        return mats, dense

    def _second_stage(self, bucket: Bucket, mats: list[_Matrix], dense: list[Segment],
                      first: Tensor) -> Handle[Tensor]:
        """Orthogonalize the averaged P's (same-shape ones as one batched QR), Q = M^T P,
        allreduce every Q as one buffer; then :meth:`_write`."""
        ps = _views(first, [x.p.shape for x in mats])
        _orthogonalize_batched(self.compressor, ps)
        qs = [self.compressor.compute_q(x.m, p) for x, p in zip(mats, ps)]
        second = torch.cat([q.reshape(-1) for q in qs]) if qs else first.new_zeros(0)
        return _reduce_as(self._q_comm, second, bucket.dtype).then(
            lambda mean_q: self._write(bucket, mats, dense, first, ps, mean_q))

    def _write(self, bucket: Bucket, mats: list[_Matrix], dense: list[Segment],
               first: Tensor, ps: list[Tensor], second: Tensor) -> Tensor:
        """Warm starts := the averaged Q's; segments := P Q^T (residuals := M - P Q^T);
        the dense segments := their means."""
        qs = _views(second, [(x.m.shape[1], x.p.shape[1]) for x in mats])
        for x, p, q in zip(mats, ps, qs):
            self.compressor.store_q(x.key, q)
            self._write_approx(bucket, x, p, q)
        offset = sum(x.p.numel() for x in mats)
        for s in dense:
            bucket.flat[s.start:s.stop] = first[offset:offset + s.numel]
            offset += s.numel
        return bucket.flat

    def _write_approx(self, bucket: Bucket, x: _Matrix, p: Tensor, q: Tensor) -> None:
        """Bucket segment := P Q^T, residual := M - P Q^T.

        When M is the segment itself (one tensor, no padding: every weight matrix
        layer-wise) this needs no temporary: M is saved into the old residual's memory (its
        values were added into M already), overwritten with P Q^T
        (:meth:`PowerSGDCompressor.product_into`) and subtracted: three memory-bound
        passes. Otherwise (bucket granularity, padding, low-precision gradients) through a dense
        approximation.
        """
        view = bucket.flat[x.segment.start:x.segment.stop]
        ef = self.error_feedback
        if x.m.data_ptr() == view.data_ptr() and x.m.numel() == view.numel():
            if ef is None:
                self.compressor.product_into(p, q, x.m)
                return
            residual = self._residual(bucket).view(x.m.shape)
            residual.copy_(x.m)
            self.compressor.product_into(p, q, x.m)
            residual.sub_(x.m)
            return
        approx = self.compressor.reconstruct(p, q, x.shape, bucket.dtype).reshape(-1)
        if ef is not None:
            torch.sub(x.corrected, approx, out=self._residual(bucket))
        view.copy_(approx)

    def _residual(self, bucket: Bucket) -> Tensor:
        """Bucket granularity: the bucket's residuals as one buffer (its tensors' residuals
        are views of it: :meth:`hexagram.compress.ErrorFeedback.bind_flat`)."""
        key = self._bucket_keys.get(bucket.index)
        if key is None or key.entries is not bucket.entries:
            key = self._bucket_keys[bucket.index] = _BucketKey(bucket.entries)
        ef = self._feedback()
        return ef.bind_flat(key, [e.name for e in key.entries],
                            [e.numel for e in key.entries], bucket.flat).buffer

    def bytes_sent(self) -> int:
        extra = self._q_comm.counter.total if self._q_comm is not self.ctx.comm else 0
        return super().bytes_sent() + extra

    def close(self) -> None:
        if self._ctx is not None and self._q_comm is not self._ctx.comm:
            self._stage2.shutdown(wait=True)
            self._q_comm.close()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.compressor.load_state_dict(state["compressor"])


def _reduce_as(comm: Communicator, work: Tensor, dtype: torch.dtype) -> Handle[Tensor]:
    """Mean of ``work`` (factors in the compressor's float32/64) over ``comm``, in place;
    the wire carries the gradients' own dtype when that is 16-bit (a bf16 model, or
    ``cast="bf16"``: half the bytes, as PyTorch's PowerSGD hook in 16 bits)."""
    if dtype.itemsize >= work.dtype.itemsize or not dtype.is_floating_point:
        return reduce(comm, work, out=work)
    wire = work.to(dtype)
    return reduce(comm, wire, out=wire).then(lambda mean: work.copy_(mean))


def _views(flat: Tensor, shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    """Consecutive views of ``flat`` with the given shapes."""
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset:offset + n].view(*shape))
        offset += n
    return out


def _orthogonalize_batched(compressor: PowerSGDCompressor, ps: list[Tensor]) -> None:
    """Orthogonalize every P in place; P's of one shape go through one batched QR (one
    LAPACK call instead of one per layer, as PyTorch's ``batch_tensors_with_same_shape``);
    the same values as one QR each."""
    by_shape: dict[tuple[int, ...], list[Tensor]] = defaultdict(list)
    for p in ps:
        by_shape[tuple(p.shape)].append(p)
    for group in by_shape.values():
        if len(group) == 1:
            compressor.orthogonalize(group[0])
            continue
        stacked = compressor.orthogonalize(torch.stack(group))
        for p, q in zip(group, stacked):
            p.copy_(q)
