"""PowerSGD (Vogels et al. 2019): rank-r approximation by one warm-started power iteration.

A tensor is viewed as a matrix M (rows, cols): an N-D tensor as (shape[0], rest); a 1-D
tensor or flat bucket of n elements as (ceil(sqrt n), ceil(n / rows)), zero-padded. With
``r = min(rank, rows, cols)`` the factors are P (rows, r) and Q (cols, r), ``M ~ P Q^T``;
the wire size is ``(rows + cols) * r * 4`` bytes (8 for float64 inputs).

**Distributed use (two allreduces, ``Aggregation.SUM``).** P and Q are linear in M given the
other factor, so the *average* of all ranks' matrices is approximated by allreducing P, then
Q. An algorithm runs, per tensor ``key`` (e.g. a parameter or bucket name)::

    c = hexagram.compress.get("powersgd", rank=2)
    ef = hexagram.compress.ErrorFeedback(c)      # PowerSGD needs error feedback
    corrected = ef.correct_(key, grad.clone())   # grad + residual
    m = c.matrix(corrected)                      # (rows, cols), work dtype
    p = c.compute_p(key, m)                      # (rows, r) = M orth(Q_warm) -> allreduce, / world
    c.orthogonalize(p)                           # in place, same result on every rank
    q = c.compute_q(m, p)                        # (cols, r) = M^T P          -> allreduce, / world
    c.store_q(key, q)                            # warm start of the next step
    mean = c.reconstruct(p, q, grad.shape, grad.dtype)   # P Q^T: the averaged gradient
    ef.update(key, corrected, mean)              # residual = local M - global approximation

Every rank must start from the same Q: the initial Q of a key is drawn from a generator
seeded with ``seed`` and a stable hash of the key (not of call order), so ranks agree
without communication. ``compute_p`` draws a fresh Q if the key is new, its matrix shape
changed, or ``warm_start`` is off.

**Single process.** ``compress(x)`` runs the same steps locally (key = ``("compress",
shape)``, so tensors of one shape share a warm start) and returns a payload (P, Q);
``decompress`` returns P Q^T. Such payloads are *not* summable one by one (P Q^T is
bilinear): carry PowerSGD with the step API above, never with a generic allreduce of
``compress`` payloads. :meth:`PowerSGDCompressor.worthwhile` says whether a shape gains
anything (small or thin tensors are better sent uncompressed).

Example:
    >>> import torch
    >>> c = PowerSGDCompressor(PowerSGDConfig(rank=1))
    >>> x = torch.outer(torch.arange(1.0, 5.0), torch.ones(6))   # rank 1: exact
    >>> bool(torch.allclose(c.decompress(c.compress(x)), x, atol=1e-5)), c.compress(x).nbytes
    (True, 40)
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hexagram.compress.base import (
    Aggregation,
    Compressor,
    Layout,
    Payload,
    check_compressible,
    check_finite,
)
from hexagram.compress.chunks import work_dtype
from hexagram.compress.faults import beyond
from hexagram.config import check_int

__all__ = ["PowerSGDCompressor", "PowerSGDConfig"]


@dataclass(frozen=True, kw_only=True)
class PowerSGDConfig:
    """Settings of ``powersgd``.

    Attributes:
        rank: r, columns of the factors. Higher => better approximation, more bytes
            ((rows + cols) * r elements).
        warm_start: reuse the previous step's Q (one power iteration per step then
            converges across steps); off => a fresh random Q every step (worse).
        seed: seed of the initial random Q (hashed with the key, equal on every rank).
    """

    rank: int = 2
    warm_start: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        check_int(self, "rank", low=1)
        check_int(self, "seed", low=0)


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """(rows, cols) of the matrix view of a tensor of ``shape`` (see the module docstring)."""
    n = shape.numel()
    if len(shape) >= 2 and shape[0] > 0:
        return shape[0], n // shape[0]
    rows = math.isqrt(n - 1) + 1 if n > 1 else 1  # ceil(sqrt(n))
    return rows, -(-n // rows)


class PowerSGDCompressor(Compressor):
    """Rank-r PowerSGD; see the module docstring for the two-phase step API."""

    name = "powersgd"
    aggregation = Aggregation.SUM
    unbiased = False
    payload_sums_elementwise = False  # P and Q are allreduced in turn (see the step API)

    def __init__(self, config: PowerSGDConfig | None = None) -> None:
        self.config = config or PowerSGDConfig()
        self._q: dict[Any, Tensor] = {}
        #: changes whenever a warm start is replaced (not merely updated in place): a
        #: caller holding views of its own batched buffer (:meth:`bind_warm_start`)
        #: rebuilds it then
        self.q_version = 0

    memory_passes = 6.0  # beyond the three matrix products, whose FLOPs the planner adds

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        """(rows, r) P; (cols, r) Q: the input's matrix view, r = min(rank, rows, cols)."""
        rows, cols = matrix_shape(torch.Size(shape))
        r = min(self.config.rank, rows, cols)
        return (((rows, r), work_dtype(dtype)), ((cols, r), work_dtype(dtype)))

    def effective_rank(self, shape: torch.Size) -> int:
        """``min(rank, rows, cols)`` for a tensor of ``shape``."""
        return min(self.config.rank, *matrix_shape(shape))

    def worthwhile(self, shape: torch.Size) -> bool:
        """True if the factors are smaller than the tensor itself."""
        rows, cols = matrix_shape(shape)
        return (rows + cols) * self.effective_rank(shape) < shape.numel()

    def matrix(self, tensor: Tensor) -> Tensor:
        """The (rows, cols) matrix of ``tensor`` in float32/64 (a view where possible)."""
        check_compressible(tensor, self.name)
        rows, cols = matrix_shape(tensor.shape)
        flat = tensor.detach().reshape(-1).to(work_dtype(tensor.dtype))
        if rows * cols != flat.numel():
            flat = torch.cat([flat, flat.new_zeros(rows * cols - flat.numel())])
        return flat.view(rows, cols)

    def compute_p(self, key: Any, m: Tensor, generator: torch.Generator | None = None
                  ) -> Tensor:
        """P = M Q (rows, r), Q this key's warm start (or a fresh seeded random Q) with
        its columns orthonormalized first (:meth:`orthonormal`, as PyTorch's
        ``powerSGD_hook``): the same column space, but P of the order of M, where a warm
        start (``M^T P``, of the order of M) made it of the order of M squared, down in
        16-bit subnormals for small gradients."""
        r = min(self.config.rank, *m.shape)
        q = self._q.get(key)
        if q is None or q.shape != (m.shape[1], r) or not self.config.warm_start \
                or q.dtype != m.dtype:
            q = self._initial_q(key, m.shape[1], r, m, generator)
        # M times a column-major Q: 5x faster than M @ Q with Q row-major (thin BLAS path)
        p = m @ self.orthonormal(q).t().contiguous().t()
        if self.checks_finite and not bool(torch.isfinite(p).all()):
            check_finite(m, self.name)
            raise ValueError(f"{self.name}: M Q overflows {m.dtype}; scale the tensor down")
        return p

    def warm_start(self, key: Any) -> Tensor | None:
        """``key``'s warm-start Q (cols, r), None before its first step."""
        return self._q.get(key)

    def bind_warm_start(self, key: Any, q: Tensor) -> None:
        """Make ``q`` (cols, r), e.g. a view of a caller's batched buffer that it updates
        in place, ``key``'s warm start, without changing :attr:`q_version`."""
        self._q[key] = q

    def initial_q(self, key: Any, cols: int, r: int, like: Tensor) -> Tensor:
        """``key``'s first Q (cols, r): the same on every rank (seeded by ``seed`` and
        ``key``), ``like``'s dtype and device."""
        return self._initial_q(key, cols, r, like, None)

    def _initial_q(self, key: Any, cols: int, r: int, like: Tensor,
                   generator: torch.Generator | None) -> Tensor:
        if generator is None:  # the same on every rank: depends on seed and key only
            seed = (self.config.seed * 1_000_003 + zlib.crc32(repr(key).encode())) % 2**63
            generator = torch.Generator(device=like.device).manual_seed(seed)
        return torch.randn(cols, r, generator=generator, dtype=like.dtype, device=like.device)

    @staticmethod
    def orthonormal(q: Tensor) -> Tensor:
        """A new tensor: :meth:`orthogonalize` of ``q`` (cols, r) or (g, cols, r); ``q``
        stays as it is (a warm start is kept as averaged, PyTorch's at the end of a step)."""
        return torch.linalg.qr(q, mode="reduced")[0]

    @staticmethod
    def orthogonalize(p: Tensor) -> Tensor:
        """Orthonormal columns spanning P's column space (in place); returns ``p``.

        Reduced Householder QR: exact (to rounding) and NaN-free for *every* finite P,
        also rank-deficient ones (a gradient of rank < r, a zero gradient), where
        Gram-Schmidt normalizes rounding noise into a column that is not orthogonal to the
        others. A dependent or zero column becomes a unit vector orthogonal to the others,
        so ``P P^T`` stays an orthogonal projection and ``P Q^T = P P^T M`` an exact
        projection of M (zero for a zero M). Deterministic given P: ranks that orthogonalize
        the same allreduced P get the same bits. LAPACK scales its norms, so columns of
        1e30 or 1e-30 neither overflow nor underflow. (rows, r) with rows >= r.
        """
        return p.copy_(PowerSGDCompressor.orthonormal(p))

    @staticmethod
    def compute_q(m: Tensor, p: Tensor) -> Tensor:
        """Q = M^T P (cols, r), with P orthogonalized (and allreduced)."""
        return (p.t() @ m).t().contiguous()  # (P^T M)^T: 13x faster than M^T @ P

    def store_q(self, key: Any, q: Tensor) -> None:
        """Keep ``q`` (the allreduced Q) as ``key``'s warm start for the next step."""
        self._q[key] = q.detach().clone()
        self.q_version += 1

    @staticmethod
    def product_into(p: Tensor, q: Tensor, out: Tensor) -> Tensor:
        """``out`` (rows, cols) := P Q^T for P (rows, r) and Q (cols, r); returns ``out``.

        Up to rank 2 as broadcast products (a multiply, then a fused multiply-add): GEMM
        with an inner dimension of 2 packs its operands and ran 2.5-3.5x slower on CPU than
        these two memory-bound passes (2233x2233 and 4096x4096, one thread); from rank 3
        GEMM wins or ties. Both are deterministic given P and Q, so ranks holding the same
        allreduced factors write the same bits.

        Example:
            >>> p, q = torch.ones(3, 2), torch.arange(4.0).view(2, 2)
            >>> PowerSGDCompressor.product_into(p, q, torch.empty(3, 2))[0].tolist()
            [1.0, 5.0]
        """
        qt = q.t().contiguous()  # row-major: GEMM's fast layout, and unit-stride broadcasts
        if p.shape[1] > 2:
            return torch.mm(p, qt, out=out)
        torch.mul(p[:, :1], qt[:1], out=out)
        if p.shape[1] == 2:
            out.addcmul_(p[:, 1:], qt[1:])
        return out

    @classmethod
    def reconstruct(cls, p: Tensor, q: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """P Q^T as a tensor of ``shape`` and ``dtype`` (matrix padding dropped)."""
        approx = cls.product_into(p, q, p.new_empty(p.shape[0], q.shape[0]))
        return approx.reshape(-1)[: shape.numel()].view(shape).to(dtype)

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        key = ("compress", tuple(tensor.shape))
        m = self.matrix(tensor)
        p = self.orthogonalize(self.compute_p(key, m, generator))
        q = self.compute_q(m, p)
        self.store_q(key, q)
        return Payload(tensors=(p, q), shape=tensor.shape, dtype=tensor.dtype)

    def decompress(self, payload: Payload) -> Tensor:
        p, q = payload.tensors
        return self.reconstruct(p, q, payload.shape, payload.dtype)

    def payload_fault(self, payload: Payload) -> Tensor:
        """A factor NaN/Inf, or a product ``P Q^T`` that may exceed the dtype's range
        (bounded by ``r max|P| max|Q|``)."""
        if "parts" in payload.meta:
            return super().payload_fault(payload)
        p, q = payload.tensors
        peaks = torch.stack([p.abs().amax(), q.abs().amax()]).double().prod()
        return beyond(peaks, payload.dtype, float(p.shape[-1]))

    def state_dict(self) -> dict[str, Any]:
        return {"q": {k: v.clone() for k, v in self._q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._q = {k: v.clone() for k, v in state["q"].items()}
        self.q_version += 1

    def __repr__(self) -> str:
        return f"PowerSGDCompressor({self.config})"
