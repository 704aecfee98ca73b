"""Error feedback invariant, PowerSGD's step API, and clear errors on bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hexagram.compress as hc
from hexagram.compress.lowrank import PowerSGDCompressor, PowerSGDConfig
from hexagram.errors import ConfigError, NonFiniteGradientError


def _g(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _res(ef: hc.ErrorFeedback, key: str) -> torch.Tensor:
    residual = ef.residual(key)
    assert residual is not None
    return residual


def _psgd(**config: Any) -> PowerSGDCompressor:
    return PowerSGDCompressor(PowerSGDConfig(**config))


@pytest.mark.parametrize("name", hc.names())
def test_sent_plus_new_residual_is_grad_plus_old_residual(name: str) -> None:
    ef = hc.ErrorFeedback(hc.get(name))
    for step in range(4):
        for key, shape in (("a", (300,)), ("b", (6, 7))):
            grad = _g(300, step).view(shape) if key == "a" else _g(42, step + 9).view(shape)
            old = ef.residual(key)
            old = torch.zeros_like(grad) if old is None else old.clone()
            sent = ef.compressor.decompress(ef.compress(key, grad))
            new = _res(ef, key)
            # equal up to float32 rounding of the terms (randomk's rescaled values are large)
            scale = sent.abs() + new.abs() + grad.abs() + old.abs()
            assert bool(((sent + new - grad - old).abs() <= 1e-6 * scale + 1e-12).all())


def test_error_feedback_makes_topk_send_everything_eventually() -> None:
    ef = hc.ErrorFeedback(hc.get("topk", k=10))
    grad, total = _g(100, 0), torch.zeros(100)
    for _ in range(200):
        total += ef.compressor.decompress(ef.compress("w", grad))
    # after T steps, sent = T * grad - residual, with the residual bounded
    assert torch.allclose(total / 200, grad, atol=0.05)


def test_update_with_what_was_counted_gtopk_style() -> None:
    ef = hc.ErrorFeedback(hc.get("topk", k=4))
    grad = torch.tensor([5.0, -4.0, 3.0, 2.0, 0.5, -0.25])
    corrected = ef.correct_("w", grad.clone())
    local = ef.compressor.decompress(ef.compressor.compress(corrected))  # 5, -4, 3, 2 kept locally
    counted = local.clone()
    counted[[2, 3]] = 0  # lost in the global selection: back into the residual
    ef.update("w", corrected, counted)
    assert _res(ef, "w").tolist() == [0.0, 0.0, 3.0, 2.0, 0.5, -0.25]
    assert torch.equal(ef.correct_("w", grad.clone()), grad + _res(ef, "w"))
    assert torch.equal(grad, torch.tensor([5.0, -4.0, 3.0, 2.0, 0.5, -0.25]))  # untouched


def test_residuals_in_state_dict_resume_exactly() -> None:
    a = hc.ErrorFeedback(hc.get("qsgd", levels=1, seed=4))
    for step in range(3):
        a.compress("w", _g(500, step))
    b = hc.ErrorFeedback(hc.get("qsgd", levels=1, seed=0))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.compress("w", _g(500, 9)).to_buffer(),
                       b.compress("w", _g(500, 9)).to_buffer())
    assert torch.equal(_res(a, "w"), _res(b, "w"))


def test_residual_key_reused_for_another_shape_is_an_error() -> None:
    ef = hc.ErrorFeedback(hc.get("sign"))
    ef.compress("w", torch.ones(4))
    with pytest.raises(ValueError, match="'w'"):
        ef.compress("w", torch.ones(5))
    ef.reset("w")
    ef.compress("w", torch.ones(5))


def test_powersgd_two_phase_protocol_equals_compressing_the_mean() -> None:
    """Two simulated ranks: allreduce(P), orthogonalize, allreduce(Q) == local on the mean."""
    ranks = [_psgd(rank=3, seed=1) for _ in range(2)]
    single = _psgd(rank=3, seed=1)
    for step in range(3):
        grads = [_g(40 * 30, 10 * step + r).view(40, 30) for r in range(2)]
        ms = [c.matrix(g) for c, g in zip(ranks, grads)]
        # allreduce (sum) then average, as the algorithm does with a collective
        p = torch.stack([c.compute_p("w", m) for c, m in zip(ranks, ms)]).mean(0)
        ranks[0].orthogonalize(p)
        q = torch.stack([c.compute_q(m, p) for c, m in zip(ranks, ms)]).mean(0)
        for c in ranks:
            c.store_q("w", q)
        out = ranks[0].reconstruct(p, q, grads[0].shape, grads[0].dtype)
        mean = (grads[0] + grads[1]) / 2
        m = single.matrix(mean)
        p1 = single.orthogonalize(single.compute_p("w", m))
        q1 = single.compute_q(m, p1)
        single.store_q("w", q1)
        assert torch.allclose(out, single.reconstruct(p1, q1, mean.shape, mean.dtype),
                              atol=1e-4)


def test_powersgd_warm_start_converges_and_columns_are_orthonormal() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 3, generator=g) @ torch.randn(3, 50, generator=g)  # rank 3
    c = hc.get("powersgd", rank=3)
    errors = []
    for _ in range(3):
        p = c.compress(x)
        errors.append(float((c.decompress(p) - x).norm() / x.norm()))
        assert torch.allclose(p.tensors[0].t() @ p.tensors[0], torch.eye(3), atol=1e-5)
    assert errors[-1] < 1e-5  # a rank-3 matrix is recovered
    cold = hc.get("powersgd", rank=1, warm_start=False)
    warm = hc.get("powersgd", rank=1)
    noisy = x + 0.1 * torch.randn(60, 50, generator=g)
    for _ in range(5):
        e_cold = float((cold.decompress(cold.compress(noisy)) - noisy).norm())
        e_warm = float((warm.decompress(warm.compress(noisy)) - noisy).norm())
    assert e_warm < e_cold  # power iteration across steps finds the top direction


def test_powersgd_initial_q_is_the_same_on_every_rank() -> None:
    m = torch.randn(8, 6)
    a, b = _psgd(seed=2), _psgd(seed=2)
    b.compute_p("other", m)  # different call order on this "rank"
    assert torch.equal(a.compute_p("w", m), b.compute_p("w", m))


@pytest.mark.parametrize(("name", "config", "field"), [
    ("topk", {"density": 0.0}, "density"), ("topk", {"density": 1.5}, "density"),
    ("randomk", {"density": -1.0}, "density"), ("qsgd", {"levels": 0}, "levels"),
    ("powersgd", {"rank": 0}, "rank"), ("minmax8", {"chunk_size": 0}, "chunk_size"),
    ("threshold", {"threshold": 0.0}, "threshold"), ("terngrad", {"clip": -1.0}, "clip"),
    ("qsgd", {"bits": 3}, "bits"),
])
def test_bad_config_names_the_field(name: str, config: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        hc.get(name, **config)


@pytest.mark.parametrize("name", hc.names())
def test_bad_tensors_raise_clear_errors(name: str) -> None:
    c = hc.get(name)
    with pytest.raises(ValueError, match="empty"):
        c.compress(torch.zeros(0))
    with pytest.raises(TypeError, match="int64"):
        c.compress(torch.arange(5))
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.ones(100)
        x[37] = bad
        with pytest.raises(NonFiniteGradientError, match=name):
            c.compress(x)


def test_k_larger_than_the_tensor_names_k() -> None:
    for name in ("topk", "randomk"):
        with pytest.raises(ValueError, match="k=10"):
            hc.get(name, k=10).compress(torch.ones(5))


def test_fp16_overflow_is_an_error_not_inf() -> None:
    with pytest.raises(ValueError, match="65504"):
        hc.get("fp16").compress(torch.tensor([1.0, 1e5]))


@pytest.mark.parametrize("name", ["topk", "efsign", "onebit", "qsgd", "terngrad"])
def test_in_place_api_keeps_the_same_residuals(name: str) -> None:
    """correct_ + update_from (and update_selected for top-k) == correct_ + update."""
    comp = hc.get(name)
    ref, fast = hc.ErrorFeedback(comp), hc.ErrorFeedback(comp)
    for step in range(3):
        g = torch.randn(1000, generator=torch.Generator().manual_seed(step))
        corrected = ref.correct_("w", g.clone())
        payload = comp.compress(corrected, torch.Generator().manual_seed(step))
        ref.update("w", corrected, comp.decompress(payload))
        mine = fast.correct_("w", g.clone())
        assert torch.equal(mine, corrected)
        again = comp.compress(mine, torch.Generator().manual_seed(step))
        if name == "topk" and step % 2:  # the sparsifier's own form of the same update
            fast.update_selected("w", mine, again.tensors[1].long())
        else:
            fast.update_from("w", mine, again)
        assert torch.equal(fast.residual("w"), ref.residual("w"))
