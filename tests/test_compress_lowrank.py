"""PowerSGD's orthogonalization on rank-deficient and zero P: exact, NaN-free, rank-agreeing.

Gram-Schmidt normalizes rounding noise when a column of P depends on the others (a
gradient of rank < r) and leaves a zero P at zero forever (its Q, hence the next warm
start, is zero too). The compressor orthogonalizes with a reduced QR instead; these tests
pin that down on one process and on two ranks running the ``powersgd`` algorithm.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hexagram.compress.lowrank import PowerSGDCompressor, PowerSGDConfig
from hexagram.launch import run_local

ROWS, COLS, RANK = 40, 30, 3


def _rank_one(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.outer(torch.randn(rows, generator=g), torch.randn(cols, generator=g))


def _assert_orthonormal(p: torch.Tensor) -> None:
    assert not bool(torch.isnan(p).any())
    eye = torch.eye(p.shape[1], dtype=p.dtype)
    assert torch.allclose(p.t() @ p, eye, atol=1e-5), p.t() @ p


@pytest.mark.parametrize("case", ["dependent", "zero", "one_zero_column", "tiny", "huge"])
def test_orthogonalize_is_orthonormal_and_deterministic(case: str) -> None:
    g = torch.Generator().manual_seed(3)
    p = {"dependent": _rank_one(ROWS, RANK, 1),  # every column a multiple of the first
         "zero": torch.zeros(ROWS, RANK),
         "one_zero_column": torch.cat([torch.randn(ROWS, 2, generator=g),
                                       torch.zeros(ROWS, 1)], 1),
         "tiny": torch.randn(ROWS, RANK, generator=g) * 1e-30,
         "huge": torch.randn(ROWS, RANK, generator=g) * 1e30}[case]
    first = PowerSGDCompressor.orthogonalize(p.clone())
    _assert_orthonormal(first)
    # every rank orthogonalizes the same allreduced P: the same bits
    assert torch.equal(first, PowerSGDCompressor.orthogonalize(p.clone()))
    if case in ("dependent", "one_zero_column"):  # P's own column space is kept
        proj = first @ (first.t() @ p)
        assert torch.allclose(proj, p, atol=1e-5)


@pytest.mark.parametrize("rank_of_m", [0, 1])
def test_compress_of_rank_deficient_matrix_is_exact(rank_of_m: int) -> None:
    """rank(M) < r: P Q^T == M (zero for a zero M), no NaN, for several warm steps."""
    c = PowerSGDCompressor(PowerSGDConfig(rank=RANK))
    m = _rank_one(ROWS, COLS, 5) if rank_of_m else torch.zeros(ROWS, COLS)
    for _ in range(3):
        payload = c.compress(m)
        _assert_orthonormal(payload.tensors[0])
        out = c.decompress(payload)
        assert not bool(torch.isnan(out).any())
        assert torch.allclose(out, m, atol=1e-4)


def test_warm_start_recovers_after_a_zero_gradient() -> None:
    """A zero step stores Q = 0; the next nonzero gradient must still come through."""
    c = PowerSGDCompressor(PowerSGDConfig(rank=1))
    c.compress(torch.zeros(ROWS, COLS))
    m = _rank_one(ROWS, COLS, 9)
    errors = [float((c.decompress(c.compress(m)) - m).norm()) for _ in range(3)]
    assert errors[-1] < 1e-4 * float(m.norm())


class _Probe(nn.Module):
    """loss = <w, x>: the gradient of ``w`` is ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(ROWS, COLS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def _worker() -> dict[str, Any]:
    import hexagram as hx

    rt = hx.init()
    net = _Probe()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = hx.DistributedDataParallel(
        net, optimizers=[opt], algorithm=hx.algorithms.get("powersgd", rank=RANK, start_iter=0))
    grads = []
    # zero everywhere, then rank 1 on every rank (rank-deficient mean), then zero again
    for x in (torch.zeros(ROWS, COLS), _rank_one(ROWS, COLS, 11 + rt.rank),
              torch.zeros(ROWS, COLS)):
        model(x).backward()
        assert net.w.grad is not None
        grads.append(net.w.grad.clone())
        opt.zero_grad()
    model.close()
    return {"grads": grads}


def test_powersgd_algorithm_on_rank_deficient_gradients_agrees_across_ranks() -> None:
    results = run_local(_worker, 2, timeout=120)
    for step in range(3):
        g0, g1 = (r["grads"][step] for r in results)
        assert not bool(torch.isnan(g0).any())
        assert torch.equal(g0, g1)  # bit for bit on every rank
    assert float(results[0]["grads"][0].abs().max()) == 0.0  # zero mean -> zero update
