"""Statistics of the stochastic compressors: unbiasedness, QSGD's variance, determinism."""

from __future__ import annotations

import pytest
import torch

import hexagram.compress as hc

DRAWS = 4000


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _assert_unbiased(draws: torch.Tensor, x: torch.Tensor) -> None:
    """Mean of (draws, n) within 5 standard errors of x (exactly x where the variance is 0)."""
    mean, se = draws.mean(0), draws.std(0) / draws.shape[0] ** 0.5
    z = (mean - x).abs() / se.clamp_min(1e-300)
    assert bool(((se > 0) | ((mean - x).abs() < 1e-12)).all())
    assert float(z[se > 0].max()) < 5.0, f"max z-score {float(z.max()):.2f}"


def _tiled_draws(name: str, x: torch.Tensor, **config: object) -> torch.Tensor:
    """DRAWS independent quantizations of x in one call: x tiled, one scale per tile."""
    c = hc.get(name, seed=1, **config)
    y = c.decompress(c.compress(x.repeat(DRAWS)))
    return y.view(DRAWS, -1)


@pytest.mark.parametrize("levels", [1, 3, 16])
def test_qsgd_unbiased(levels: int) -> None:
    x = _x(64)
    _assert_unbiased(_tiled_draws("qsgd", x, levels=levels, bucket_size=64), x)


def test_terngrad_unbiased() -> None:
    x = _x(64)  # tiling keeps max|x|, the per-tensor scale
    _assert_unbiased(_tiled_draws("terngrad", x), x)


def test_randomk_unbiased() -> None:
    x = _x(64)
    # density 1/8: strata of 8 elements, 8 per tile, so every tile is an independent draw
    _assert_unbiased(_tiled_draws("randomk", x, density=1 / 8), x)
    # uneven strata (n / k not an integer), drawn call by call
    c = hc.get("randomk", k=3, seed=2)
    small = _x(10, seed=5)
    _assert_unbiased(torch.stack([c.decompress(c.compress(small)) for _ in range(2000)]),
                     small)


def test_a_biased_compressor_fails_the_unbiasedness_check() -> None:
    x = _x(64)
    with pytest.raises(AssertionError):
        _assert_unbiased(_tiled_draws("randomk", x, density=1 / 8, rescale=False), x)


@pytest.mark.parametrize("levels", [1, 2, 7])
def test_qsgd_variance_matches_theory_and_bound(levels: int) -> None:
    n, x = 64, _x(64, seed=3)
    y = _tiled_draws("qsgd", x, levels=levels, bucket_size=n)
    measured = float(((y - x) ** 2).sum(1).mean())
    # stochastic rounding of r = s|x|/||x|| to a neighbour: variance (||x||/s)^2 p (1 - p)
    r = levels * x.abs() / x.norm()
    frac = r - r.floor()
    exact = float(((x.norm() / levels) ** 2 * frac * (1 - frac)).sum())
    assert abs(measured - exact) < 0.1 * exact
    bound = min(n / levels**2, n**0.5 / levels) * float(x.norm()) ** 2
    assert measured <= bound


@pytest.mark.parametrize(("name", "config"), [("qsgd", {}), ("terngrad", {}),
                                              ("randomk", {}),
                                              ("topk", {"approximate": True})])
def test_reproducible_from_seed_and_state(name: str, config: dict[str, object]) -> None:
    x = _x(100_000).float()

    def run(c: hc.Compressor, steps: int) -> list[torch.Tensor]:
        return [c.compress(x).to_buffer() for _ in range(steps)]

    a, b = hc.get(name, seed=7, **config), hc.get(name, seed=7, **config)
    first, second = run(a, 2), run(b, 2)
    assert all(torch.equal(u, v) for u, v in zip(first, second))
    if name != "topk":  # topk's selection is exact: its seed only guides the sampling
        assert not torch.equal(run(hc.get(name, seed=8, **config), 1)[0], first[0])
        assert not torch.equal(first[0], first[1])  # the generator advances
    # resume from a checkpoint: the continuation is identical
    state = a.state_dict()
    c = hc.get(name, seed=0, **config)
    c.load_state_dict(state)
    assert torch.equal(run(c, 1)[0], run(a, 1)[0])
    # an explicit generator overrides the own one
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(a.compress(x, g1).to_buffer(), b.compress(x, g2).to_buffer())
