"""DGC takes the optimizer's SGD momentum over (a drop-in) and gives it back on close.

Random-k with error feedback shares the same momentum correction (:mod:`hexagram.
algorithms.momentum_correction`); at density 1 it too is the optimizer's momentum SGD.
Without feedback (its default, unbiased) it leaves the optimizer's momentum alone.

An explicit DGC momentum stacked on the optimizer's is warned with its lr factor; at
density 1 DGC with the momentum taken over *is* the optimizer's momentum SGD (with weight
decay), and with the paper's momentum factor masking it is SGD without momentum.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import hexagram as hx
from hexagram.auto import choose
from hexagram.launch import run_local


def _wrap(label: str, opt_kwargs: dict[str, Any]) -> dict[str, Any]:
    """On this rank: wrap with ``label``; optimizer groups while wrapped and after close."""
    hx.init()
    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, **opt_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=choose.make(label))
    algo = model.algorithm
    wrapped = {k: opt.param_groups[0][k] for k in ("momentum", "weight_decay")}
    factors = dict(getattr(algo, "factors", {}))
    model(torch.randn(3, 4)).sum().backward()  # one step runs with the taken-over momentum
    opt.step()
    model.close()
    return {"warnings": [str(w.message) for w in caught if label.split(":")[0] in
                         str(w.message)],
            "wrapped": wrapped, "factors": factors,
            "closed": {k: opt.param_groups[0][k] for k in ("momentum", "weight_decay")}}


def _wrap_all(cases: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [_wrap(label, kw) for label, kw in cases]


def _same_as_sgd(masking: bool | None, momentum: float) -> float:
    """Max |w_dgc - w_sgd| after 5 steps: DGC at density 1 (1 rank, taking SGD momentum 0.9
    over) against plain torch SGD with ``momentum``; ``masking=None``: random-k at density
    1 instead of DGC."""
    torch.manual_seed(0)
    ref, net = nn.Linear(8, 4), nn.Linear(8, 4)
    net.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum,
                              weight_decay=1e-3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        algo = hx.algorithms.get("randomk", density=1.0, error_feedback=True) \
            if masking is None else \
            hx.algorithms.get("dgc", density=1.0, warmup_density=1.0, masking=masking)
        model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algo)
    for step in range(5):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            (m(x) ** 2).sum().backward()
            o.step()
            o.zero_grad()
    model.close()
    return max(float((a - b).abs().max()) for a, b in zip(net.parameters(), ref.parameters()))


def _run_all(cases: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return {"wraps": [_wrap(label, kw) for label, kw in cases],
            "exact": {(m, mom): _same_as_sgd(m, mom) for m, mom in
                      ((False, 0.9), (True, 0.0), (True, 0.9), (None, 0.9))}}


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    cases = [("dgc", {"momentum": 0.9, "weight_decay": 1e-4}),
             ("dgc:momentum=0.9", {"momentum": 0.9}),
             ("dgc:momentum=0.9", {}),
             ("dgc", {"momentum": 0.9, "nesterov": True}),
             ("randomk:error_feedback=true", {"momentum": 0.9, "weight_decay": 1e-4}),
             ("randomk", {"momentum": 0.9})]
    return run_local(_run_all, 1, args=(cases,), timeout=120)[0]


def test_dgc_takes_the_sgd_momentum_over_and_gives_it_back(results: dict[str, Any]) -> None:
    took = results["wraps"][0]
    (message,) = took["warnings"]
    assert "took over the optimizer's SGD momentum 0.9" in message, message
    assert took["wrapped"] == {"momentum": 0.0, "weight_decay": 0.0}
    assert set(took["factors"].values()) == {(0.9, 1e-4)}
    assert took["closed"] == {"momentum": 0.9, "weight_decay": 1e-4}


def test_dgc_stacked_momentum_warns_with_the_factor(results: dict[str, Any]) -> None:
    stacked, alone, nesterov = results["wraps"][1:4]
    (message,) = stacked["warnings"]
    assert "multiplied by about 0.1" in message and "momentum=0.9" in message, message
    assert stacked["wrapped"]["momentum"] == 0.9  # not taken over: the user chose both
    assert alone["warnings"] == [] and alone["factors"] == {}  # the paper's usage
    # Nesterov is not DGC's correction: left to the optimizer, DGC momentum 0
    assert nesterov["warnings"] == [] and nesterov["wrapped"]["momentum"] == 0.9


def test_dense_dgc_is_the_optimizers_momentum_sgd(results: dict[str, Any]) -> None:
    exact = results["exact"]  # float rounding only: the sums run in another order
    assert exact[False, 0.9] < 1e-5  # taken over, no masking: momentum SGD + weight decay
    assert exact[True, 0.0] < 1e-5  # masking drops all velocity at density 1
    assert exact[True, 0.9] > 1e-3  # the comparison can tell the two apart


def test_randomk_takes_the_momentum_over_and_is_momentum_sgd_when_dense(
        results: dict[str, Any]) -> None:
    took = results["wraps"][4]
    (message,) = took["warnings"]
    assert message.startswith("algorithm 'randomk': took over the optimizer's SGD momentum")
    assert took["wrapped"] == {"momentum": 0.0, "weight_decay": 0.0}
    assert took["closed"] == {"momentum": 0.9, "weight_decay": 1e-4}
    assert results["exact"][None, 0.9] < 1e-5
    unbiased = results["wraps"][5]
    assert unbiased["warnings"] == [] and unbiased["wrapped"]["momentum"] == 0.9


# -- the bucket-wide path is the per-segment arithmetic, bit for bit ----------------------
class _OldDGC:
    """DGC's per-segment encoding as it was written before the bucket-wide ``_foreach``
    path (clip, velocity, v = u + residual, top-k, masking by boolean indexing): the
    reference the algorithm must equal bit for bit."""

    def __init__(self, comp: Any, clip: float, masking: bool, factors: dict[str, Any],
                 params: dict[str, torch.Tensor]) -> None:
        from hexagram.compress.feedback import ErrorFeedback

        self.comp, self.clip, self.masking = comp, clip, masking
        self.factors, self.params = factors, params
        self.ef, self.momenta = ErrorFeedback(comp), {}

    def encode(self, entries: Any, start: int, tensor: torch.Tensor) -> Any:
        norm = float(tensor.norm())
        if self.clip > 0 and norm > self.clip:
            tensor.mul_(self.clip / norm)
        moms = []
        for e in entries:
            part = tensor[e.offset - start:e.offset - start + e.numel]
            u = self.momenta.setdefault(e.name, torch.zeros(e.numel))
            m, wd = self.factors[e.name]
            u.mul_(m).add_(part).add_(self.params[e.name].detach().reshape(-1), alpha=wd)
            moms.append(u)
            self.ef.correct_(e.name, part.copy_(u))
        payload = self.comp.compress(tensor)
        values, indices = payload.tensors
        sent = indices[values != 0].long()
        for e, u in zip(entries, moms if self.masking else []):
            lo = e.offset - start
            u.index_fill_(0, sent[(sent >= lo) & (sent < lo + e.numel)] - lo, 0.0)
        if len(entries) == 1:
            self.ef.update_from(entries[0].name, tensor, payload)
        else:
            sent_dense = self.comp.decompress(payload).reshape(-1)
            for e in entries:
                a = e.offset - start
                self.ef.update(e.name, tensor[a:a + e.numel], sent_dense[a:a + e.numel])
        return payload


def _nets(wide: bool) -> tuple[nn.Module, nn.Module]:
    """Two copies of the test model; ``wide``: two hidden layers of one shape (segments of
    equal length are selected as the rows of one matrix)."""
    torch.manual_seed(0)
    mids = [nn.Linear(30, 30), nn.Tanh(), nn.Linear(30, 30), nn.Tanh()] if wide else []
    net = nn.Sequential(nn.Linear(20, 30), nn.Tanh(), *mids, nn.Linear(30, 5))
    ref = copy.deepcopy(net)
    return net, ref


def _optimizer(net: nn.Module, wide: bool) -> torch.optim.SGD:
    """SGD momentum 0.9, weight decay 1e-3; ``wide``: the first layer in a group of its own
    (momentum 0.5, no weight decay): the taken-over momenta differ per tensor."""
    if not wide:
        return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    first = list(net[0].parameters())
    rest = [p for p in net.parameters() if all(p is not q for q in first)]
    return torch.optim.SGD([{"params": first, "momentum": 0.5},
                            {"params": rest, "weight_decay": 1e-3}], lr=0.05, momentum=0.9)


def _bitwise_worker(granularity: str, masking: bool, wide: bool) -> float:
    """2 ranks: DGC (clipping, masking, SGD momentum and weight decay taken over) against
    :class:`_OldDGC` on the same local gradients; the largest difference of the reduced
    gradients over 4 steps (0.0: the same bits). ``wide``: one bucket of 8 tensors, two
    optimizer groups, and a sparsity warm-up whose density changes every step."""
    import torch.distributed as dist

    import hexagram.compress as hc
    from hexagram.algorithms.compressed import segments
    from hexagram.algorithms.dgc import density_at
    from hexagram.compress.base import Payload
    from hexagram.compress.combine import decode_sum

    hx.init()
    net, ref = _nets(wide)
    opt = _optimizer(net, wide)
    limit, size_mb = 0.5, (1.0, 1.0) if wide else (0.002, 0.001)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hx.DistributedDataParallel(
            net, optimizers=[opt], bucket_size_mb=size_mb[0], first_bucket_mb=size_mb[1],
            algorithm=hx.algorithms.get("dgc", density=0.1, clip_norm=limit,
                                        masking=masking, granularity=granularity,
                                        warmup_steps=2 if wide else 0, warmup_density=0.5))
    assert not wide or len(model.buckets) == 1
    old = _OldDGC(hc.get("topk", density=0.1), limit / 2 ** 0.5, masking,
                  dict(model.algorithm.factors), dict(ref.named_parameters()))
    worst, gen = 0.0, torch.Generator().manual_seed(dist.get_rank())
    for step in range(4):
        old.comp = hc.get("topk", density=density_at(model.algorithm.config, step))
        x = torch.randn(8, 20, generator=gen)
        ref.zero_grad()
        ref(x).square().mean().backward()
        model(x).square().mean().backward()
        for b in model.buckets:
            local = torch.cat([dict(ref.named_parameters())[e.name].grad.reshape(-1)
                               for e in b.entries])
            for s in segments(b, granularity):
                payload = old.encode(s.entries, s.start, local[s.start:s.stop])
                ranks = []  # every rank's (values, indices), in rank order
                for t in payload.tensors:
                    ranks.append([torch.empty_like(t) for _ in range(2)])
                    dist.all_gather(ranks[-1], t)
                payloads = [Payload(tensors=(v, i), shape=payload.shape, dtype=payload.dtype)
                            for v, i in zip(*ranks)]
                expect = decode_sum(old.comp, payloads, torch.empty(s.numel),
                                    lambda t: t.div_(2))
                got = torch.cat([p.grad.reshape(-1) for e in s.entries
                                 for n, p in net.named_parameters() if n == e.name])
                worst = max(worst, float((got - expect).abs().max()))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), net.parameters()):
                p.copy_(q)
    model.close()
    return worst


@pytest.mark.parametrize("granularity, masking, wide", [
    ("layer", True, False), ("layer", False, False), ("bucket", True, False),
    ("layer", True, True), ("bucket", False, True)])
def test_bucket_wide_dgc_is_the_per_segment_arithmetic(granularity: str, masking: bool,
                                                        wide: bool) -> None:
    assert run_local(_bitwise_worker, 2, args=(granularity, masking, wide), timeout=120) \
        == [0.0, 0.0]
