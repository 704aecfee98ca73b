"""PowerSGD (Vogels et al. 2019): rank-r gradient approximation by one power iteration.

Per matrix ``M`` (n x m: a weight's gradient plus its error-feedback residual, viewed as
``shape[0]`` rows) and warm-started factor ``Q`` (m x r)::

    P = M Q          allreduce-mean P (n x r), then orthonormalize its columns
    Q = M^T P        allreduce-mean Q (m x r), kept for next step (warm start)
    approx = P Q^T   the update every rank applies; residual = M - approx

Both allreduces sum factors in full precision (they are linear in ``M``), so the whole
bucket is one job on the communicator: the P stage also carries the bucket's vectors (biases)
and small matrices, which are sent uncompressed (they would not shrink: ``r (n + m) >= n m``).
The first ``start_iter`` steps are plain allreduce, as the paper's warm-up.

With ``granularity="bucket"`` the whole bucket is one ``ceil(sqrt(N))``-row matrix (zero
padded): one pair of factors for the model instead of one per layer.

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("powersgd", rank=4).config.rank
    4
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hexagram.algorithms.compressed import CompressedAlgorithm, CompressedConfig, Segment, segments
from hexagram.buckets import Bucket
from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator, Handle
from hexagram.config import check_int

__all__ = ["PowerSGDAlgorithm", "PowerSGDConfig", "matrix_shape"]


@dataclass(frozen=True, kw_only=True)
class PowerSGDConfig(CompressedConfig):
    """Config of :class:`PowerSGDAlgorithm` (plus :class:`CompressedConfig`'s fields).

    Attributes:
        rank: r, columns of the factors; higher => closer to the true gradient, more bytes
            (r (n + m) floats per n x m matrix).
        start_iter: steps of plain allreduce before compressing (0 => compress at once).
        warm_start: reuse last step's Q (True, as the paper: one power iteration per step
            then converges over steps) or draw a fresh random Q every step.
        error_feedback: carry ``M - approx`` to the next step (needed for convergence).
    """

    rank: int = 2
    start_iter: int = 10
    warm_start: bool = True
    error_feedback: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self, "rank", low=1, high=1 << 16)
        check_int(self, "start_iter", low=0)


def matrix_shape(segment: Segment, granularity: str, rank: int) -> tuple[int, int] | None:
    """(n, m) the segment is compressed as, or ``None`` to send it uncompressed."""
    if granularity == "bucket":
        n = math.isqrt(segment.numel - 1) + 1 if segment.numel > 1 else 1
        shape = (n, -(-segment.numel // n))
    else:
        e = segment.entries[0]
        if len(e.shape) < 2:
            return None
        shape = (e.shape[0], e.numel // e.shape[0])
    n, m = shape
    return shape if rank * (n + m) < n * m else None


@dataclass
class _Matrix:
    segment: Segment
    key: str
    m: Tensor  # (n, m): gradient + residual, zero padded
    q: Tensor  # (m, r)


class PowerSGDAlgorithm(CompressedAlgorithm):
    """Rank-r PowerSGD with warm start and error feedback; see :class:`PowerSGDConfig`."""

    name = "powersgd"

    def __init__(self, config: PowerSGDConfig | None = None) -> None:
        super().__init__(config or PowerSGDConfig())
        self.config: PowerSGDConfig
        self.q_factors: dict[str, Tensor] = {}
        self._shared_seed = True  # fresh Q must be the same on every rank

    def reduce_bucket(self, bucket: Bucket) -> Handle[Tensor]:
        comm = self.ctx.comm
        if self.step < self.config.start_iter:
            return primitives.allreduce(comm, bucket.flat, average=True)
        mats, dense = self._prepare(bucket)
        # stage 1 buffer: every P (n x r) then the uncompressed segments
        first = torch.cat([(x.m @ x.q).reshape(-1) for x in mats]
                          + [bucket.flat[s.start:s.stop] for s in dense])
        if comm.size == 1:
            return Handle.completed(self._finish(bucket, mats, dense, first, None),
                                    "powersgd")

        def job() -> Tensor:
            return self._finish(bucket, mats, dense, first, comm)

        return comm.submit("powersgd.p", job, comm.ring_allreduce_bytes(first))

    def _prepare(self, bucket: Bucket) -> tuple[list[_Matrix], list[Segment]]:
        mats: list[_Matrix] = []
        dense: list[Segment] = []
        r = self.config.rank
        for seg in segments(bucket, self.config.granularity):
            shape = matrix_shape(seg, self.config.granularity, r)
            if shape is None:
                dense.append(seg)
                continue
            n, m = shape
            grad = bucket.flat[seg.start:seg.stop]
            if self.config.error_feedback:
                grad = grad + self.residual(seg, grad)
            padded = torch.zeros(n * m, dtype=grad.dtype, device=grad.device)
            padded[:seg.numel] = grad
            key = "|".join(seg.names)
            mats.append(_Matrix(seg, key, padded.view(n, m), self._q(key, m, grad)))
        return mats, dense

    def _q(self, key: str, m: int, like: Tensor) -> Tensor:
        q = self.q_factors.get(key)
        if q is None or not self.config.warm_start or q.shape[0] != m:
            q = torch.randn(m, self.config.rank, generator=self.generator, dtype=like.dtype,
                            device=like.device)
        return q

    def _finish(self, bucket: Bucket, mats: list[_Matrix], dense: list[Segment],
                first: Tensor, comm: Communicator | None) -> Tensor:
        """Runs on the issuing thread: both allreduces, orthogonalization, residuals."""
        _allreduce_mean(first, comm)
        ps, offset = [], 0
        for x in mats:
            n = x.m.shape[0]
            ps.append(torch.linalg.qr(first[offset:offset + n * x.q.shape[1]]
                                      .view(n, -1)).Q)  # orthonormal columns, (n, r)
            offset += n * x.q.shape[1]
        second = torch.cat([(x.m.T @ p).reshape(-1) for x, p in zip(mats, ps)]) if mats \
            else first.new_zeros(0)
        if comm is not None:
            comm.counter.add("powersgd.q", comm.ring_allreduce_bytes(second))
        _allreduce_mean(second, comm)
        out = torch.empty_like(bucket.flat)
        q_offset = 0
        for x, p in zip(mats, ps):
            q = second[q_offset:q_offset + x.q.numel()].view_as(x.q).clone()
            q_offset += x.q.numel()
            approx = (p @ q.T).reshape(-1)[:x.segment.numel]
            out[x.segment.start:x.segment.stop] = approx
            if self.config.error_feedback:
                self.set_residual(x.segment, x.m.reshape(-1)[:x.segment.numel] - approx)
            self.q_factors[x.key] = q
        for s in dense:
            out[s.start:s.stop] = first[offset:offset + s.numel]
            offset += s.numel
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "q_factors": {k: q.clone() for k, q in self.q_factors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.q_factors = {k: q.clone() for k, q in state["q_factors"].items()}


def _allreduce_mean(buf: Tensor, comm: Communicator | None) -> None:
    """In-place mean over ranks (blocking; on the issuing thread)."""
    if comm is None or comm.size == 1 or buf.numel() == 0:
        return
    buf.div_(comm.size)
    work = dist.all_reduce(buf, group=comm.group, async_op=True)
    assert work is not None
    work.wait(comm.timeout)
