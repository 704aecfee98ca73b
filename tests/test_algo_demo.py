"""DeMo (decoupled momentum): the paper's update by hand with scipy's DCT, exact wire bytes,
bit-identical weights on every rank, bit-exact resumption, the SGD momentum taken over
(warned) and a clear error for an optimizer it cannot take over."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import numpy as np
import pytest
import scipy.fft
import torch
import torch.distributed as dist
from torch import nn

from hexagram.algorithms import registry
from hexagram.compress.dct import DCTTopKCompressor, DCTTopKConfig
from hexagram.errors import ConfigError
from hexagram.launch import run_local

LR, CHUNK, K = 0.05, 8, 3


def _hand_fast(m: np.ndarray) -> np.ndarray:
    """IDCT of the K largest-magnitude DCT-II coefficients of each chunk (scipy's DCT)."""
    out = np.zeros_like(m)
    for start in range(0, m.size, CHUNK):
        spec = scipy.fft.dct(m[start : start + CHUNK], type=2, norm="ortho")
        keep = np.zeros_like(spec)
        top = np.argsort(-np.abs(spec), kind="stable")[:K]
        keep[top] = spec[top]
        out[start : start + CHUNK] = scipy.fft.idct(keep, type=2, norm="ortho")
    return out


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _hand_error() -> tuple[float, list[str], int, int]:
    """(max |wrapped - reference| over 5 steps, warnings, bytes sent, expected bytes)."""
    import hexagram as hx

    torch.manual_seed(0)
    net, ref = nn.Linear(8, 2, bias=False), nn.Linear(8, 2, bias=False)
    ref.load_state_dict(net.state_dict())
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=hx.algorithms.get(
            "decoupled_momentum", chunk=CHUNK, k=K, wire_dtype="float32"))
    m, worst, world = np.zeros(16), 0.0, dist.get_world_size()
    for step in range(5):
        _step(model, opt, step)
        x, y = _batch(step)
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        m = 0.9 * m + ref.weight.grad.double().numpy().reshape(-1)
        q = _hand_fast(m)
        m = m - q
        total = torch.from_numpy(q)
        dist.all_reduce(total)
        mean = total / world
        update = mean.sign() * mean.norm() / 4.0 / (1 - 0.9)  # rms over 16, SGD's 1/(1-m)
        with torch.no_grad():
            ref.weight -= LR * update.view(2, 8).float()
        worst = max(worst, float((net.weight - ref.weight).detach().abs().max()))
    # per step: one allgather of 2 chunks x 3 float32 values + 6 positions of 3 bits, and
    # the engine's agreement on non-finite gradients (a ring allreduce of one int64)
    expected = 5 * ((world - 1) * (6 * 4 + 3) + 2 * (world - 1) * 8 // world)
    sent = model.bytes_sent()
    model.close()
    return worst, [str(w.message) for w in caught], sent, expected


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 40), nn.Tanh(), nn.Linear(40, 2))


def _resume_and_identity() -> tuple[float, bool, list[str]]:
    import hexagram as hx
    from hexagram.elastic.state import residual_tensors

    def build() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return net, opt, hx.DistributedDataParallel(
                net, [opt], hx.algorithms.get("decoupled_momentum"))

    net, opt, model = build()
    for s in range(3):
        _step(model, opt, s)
    saved = copy.deepcopy((net.state_dict(), opt.state_dict(), model.algorithm_state_dict()))
    for s in range(3, 7):
        _step(model, opt, s)
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    seen = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(seen, flat)
    net2, opt2, model2 = build()
    net2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    model2.load_algorithm_state_dict(saved[2])
    for s in range(3, 7):
        _step(model2, opt2, s)
    err = max(float((a - b).detach().abs().max())
              for a, b in zip(net.parameters(), net2.parameters()))
    model.close()
    model2.close()
    return err, all(torch.equal(seen[0], s) for s in seen), sorted(residual_tensors(saved[2]))


def _refuses_adam() -> str:
    import hexagram as hx

    net = _net()
    try:
        hx.DistributedDataParallel(net, optimizers=[torch.optim.Adam(net.parameters())],
                                   algorithm=hx.algorithms.get("decoupled_momentum"))
    except ConfigError as e:
        return str(e)
    return "no error"


def _worker() -> dict[str, Any]:
    import hexagram as hx

    hx.init()
    return {"hand": _hand_error(), "resume": _resume_and_identity(), "adam": _refuses_adam()}


def test_demo_matches_the_paper_by_hand() -> None:
    for rank, result in enumerate(run_local(_worker, 2, timeout=120)):
        worst, caught, sent, expected = result["hand"]
        assert worst <= 1e-6, f"rank {rank}: DeMo off the hand-computed update by {worst}"
        assert any("took over the optimizer's SGD momentum 0.9" in w for w in caught), caught
        assert sent == expected, f"rank {rank}: {sent} bytes sent, wire format says {expected}"
        err, identical, residuals = result["resume"]
        assert err == 0.0 and identical, f"rank {rank}: resume {err}, identical {identical}"
        # the momenta are what live mode's residual policy re-centres
        assert residuals == [f"feedback/residuals/{i}.{p}" for i in (0, 2)
                             for p in ("bias", "weight")], residuals
        assert "cannot take over Adam" in result["adam"], result["adam"]


def test_dct_compressor_inverts_and_keeps_the_largest() -> None:
    c = DCTTopKCompressor(DCTTopKConfig(chunk=64, k=64, wire_dtype="float32"))
    x = torch.randn(130)
    assert torch.allclose(c.decompress(c.compress(x)), x, atol=1e-5)
    c = DCTTopKCompressor()  # the paper's 64 / 32, bfloat16 values, 6-bit positions
    assert c.compress(torch.randn(128)).nbytes == 2 * 32 * 2 + 2 * 32 * 6 // 8
    with pytest.raises(ConfigError, match="granularity"):
        registry.get("decoupled_momentum", granularity="bucket")


def test_per_chunk_compressors_check_finiteness_by_the_shared_switch() -> None:
    """NaN raises while ``checks_finite`` is on (a standalone compressor, SparseLoCo), and
    passes through, with no host read, where an algorithm that checks its buckets once per
    step turned it off (DeMo); a payload of another config is refused by name."""
    from hexagram.compress.chunk_topk import ChunkTopKCompressor, ChunkTopKConfig
    from hexagram.errors import NonFiniteGradientError

    x = torch.randn(256)
    x[7] = float("nan")
    for comp in (DCTTopKCompressor(), ChunkTopKCompressor(ChunkTopKConfig(chunk=64))):
        with pytest.raises(NonFiniteGradientError):
            comp.compress(x)
        comp.checks_finite = False
        assert not torch.isfinite(comp.decompress(comp.compress(x))).all(), comp.name
    assert registry.get("decoupled_momentum").compressor.checks_finite is False
    other = DCTTopKCompressor(DCTTopKConfig(k=16)).compress(torch.randn(256))
    with pytest.raises(ValueError, match="another config"):
        DCTTopKCompressor().decompress(other)
    other = ChunkTopKCompressor(ChunkTopKConfig(chunk=32)).compress(torch.randn(256))
    with pytest.raises(ValueError, match="another config"):
        ChunkTopKCompressor(ChunkTopKConfig(chunk=64)).decompress(other)
