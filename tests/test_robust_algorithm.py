"""The ``robust`` algorithm on real process groups: shard-wise results equal the aggregators
on whole vectors, bytes scale like a ring allreduce, NaN ranks are outvoted, attacks are
injected by a wrapper, bad f is refused with the limit named."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hexagram.compress import get
from hexagram.errors import ConfigError
from hexagram.launch import run_local
from hexagram.robust.shard_reduce import ReduceSpec, reduce_rows

P, D = 5, 37  # 37 is not a multiple of 5: the last shard is padded
CASES = [("median", None), ("trimmed_mean", None), ("krum", None), ("multikrum", None),
         ("geomed", None), ("centered_clip", None), ("trimmed_mean", "nnm"),
         ("krum", "bucketing")]


def _vectors() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(P, D, generator=g)
    x[P - 1] *= -20  # one attacker
    return x


def _reducer(spec: ReduceSpec) -> Any:
    return lambda rows, info: reduce_rows(rows, spec, info.allreduce, None,
                                          torch.Generator().manual_seed(5))


def _worker() -> dict[str, Any]:
    """Both halves in one spawned job: five ranks start once (start-up dominates here)."""
    import hexagram as hx

    rt = hx.init(timeout=60)
    return {**_shard_part(rt), **_ddp_part(rt)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local(_worker, P, timeout=240)


def _shard_part(rt: Any) -> dict[str, Any]:
    from hexagram.comm.communicator import Communicator
    from hexagram.comm.shards import shard_map

    comm = Communicator(None, rt.timeout, "test")
    x = _vectors()
    out: dict[str, Any] = {}
    for aggregator, pre in CASES:
        spec = ReduceSpec(aggregator=aggregator, f=1, pre=pre)
        out[(aggregator, pre)] = shard_map(comm, x[rt.rank].clone(), _reducer(spec)).wait()
    bad = x.clone()
    bad[P - 1] = float("nan")
    trim = ReduceSpec(aggregator="trimmed_mean", f=1)
    out["nan"] = shard_map(comm, bad[rt.rank].clone(),
                           lambda rows, info: reduce_rows(rows, trim, info.allreduce)).wait()
    before = comm.counter.by_op()
    out["minmax8"] = shard_map(comm, x[rt.rank].clone(),
                               lambda rows, info: reduce_rows(rows, trim), get("minmax8")).wait()
    after = comm.counter.by_op()
    out["bytes"] = before
    out["bytes8"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    comm.close()
    return out


@pytest.mark.timeout(250)
def test_shard_map_equals_whole_vector_aggregators_and_counts_bytes(
        results: list[dict[str, Any]]) -> None:
    x = _vectors()
    for aggregator, pre in CASES:
        spec = ReduceSpec(aggregator=aggregator, f=1, pre=pre)
        expected = reduce_rows(x, spec, generator=torch.Generator().manual_seed(5))
        for out in results:
            assert torch.allclose(out[(aggregator, pre)], expected, atol=1e-5), (aggregator, pre)
    honest = reduce_rows(x[: P - 1], ReduceSpec(aggregator="trimmed_mean", f=0))
    plain = reduce_rows(x, ReduceSpec(aggregator="trimmed_mean", f=1))
    m = -(-D // P)  # 8 elements per shard
    for out in results:
        assert torch.allclose(out["nan"], honest, atol=1e-6)  # NaN rank dropped, f lowered
        assert (out["minmax8"] - plain).abs().max() < 0.1 * plain.abs().max()
        sent = out["bytes"]
        # per call: all-to-all sends 4 of 5 shards, allgather forwards my shard 4 times
        calls = len(CASES) + 1
        assert sent["shard_map.alltoall"] == calls * 4 * m * 4
        assert sent["shard_map.allgather"] == calls * 4 * m * 4
        # one Gram allreduce (n^2 + n float64, n = P rows or P + 1 with centered clipping's
        # center) per distance-based or pre-aggregated call, ring: 2 (P-1)/P of it
        ring = [2 * (P - 1) * (n * n + n) * 8 // P for n in (P, P, P, P + 1, P, P)]
        assert sent["shard_map.sync"] == sum(ring)
        # 8-bit payloads: each shard's codes plus its min-max header, on both legs
        shard8 = get("minmax8").compress(torch.zeros(m)).nbytes
        assert shard8 < m * 4
        assert out["bytes8"]["shard_map.alltoall"] == 4 * shard8
        assert out["bytes8"]["shard_map.allgather"] == 4 * shard8


ATTACKED = [("sign_flip", "median"), ("scale", "krum"), ("alie", "geomed"),
            ("nan", "trimmed_mean")]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _train(algorithm: Any, steps: int = 4, momentum: float = 0.0) -> list[torch.Tensor]:
    import hexagram as hx

    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=momentum,
                          weight_decay=0.01 if momentum else 0.0)
    ddp = hx.DistributedDataParallel(net, optimizers=[opt],
                                     algorithm=algorithm, bucket_size_mb=0.0005,
                                     first_bucket_mb=0.0005)
    g = torch.Generator().manual_seed(3)  # the same data on every rank
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    ddp.close()
    assert opt.param_groups[0]["momentum"] == momentum  # given back at close
    return [p.detach().clone() for p in net.parameters()]


def _ddp_part(rt: Any) -> dict[str, Any]:
    import hexagram as hx
    from hexagram.bench.robust import SentAttacked
    from hexagram.testing.attacks import AttackConfig, AttackedAlgorithm

    out: dict[str, Any] = {"allreduce": _train("allreduce")}
    # worker momentum taken over from SGD momentum 0.9 + weight decay: a drop-in
    out["allreduce_m"] = _train("allreduce", momentum=0.9)
    out["robust_m"] = _train("robust", momentum=0.9)
    sent = SentAttacked(hx.algorithms.get("robust", aggregator="median"),
                        AttackConfig(name="nan", ranks=(rt.world_size - 1,)))
    out["nan_m"] = _train(sent, momentum=0.9)
    # the attacker corrupts what it sends, its own momentum stays finite
    out["attacker_finite"] = all(bool(torch.isfinite(m).all())
                                 for m in sent.inner.worker.buffers.values())
    out["sent_allreduce"] = _train(SentAttacked(hx.algorithms.get("allreduce"), AttackConfig(
        name="sign_flip", ranks=(rt.world_size - 1,))))
    out["robust"] = _train("robust")  # defaults: trimmed mean, f = 1
    for attack, aggregator in ATTACKED:
        algo = AttackedAlgorithm(hx.algorithms.get("robust", aggregator=aggregator),
                                 AttackConfig(name=attack, ranks=(rt.world_size - 1,)))
        out[(attack, aggregator)] = _train(algo)
    plain = AttackedAlgorithm(hx.algorithms.get("allreduce"),
                              AttackConfig(name="sign_flip", ranks=(rt.world_size - 1,)))
    out["attacked_allreduce"] = _train(plain)
    try:
        _train(hx.algorithms.get("robust", aggregator="krum", f=2))
    except ConfigError as exc:
        out["error"] = str(exc)
    return out


@pytest.mark.timeout(250)
def test_robust_trains_like_allreduce_when_honest_and_resists_attacks(
        results: list[dict[str, Any]]) -> None:
    reference = results[0]["allreduce"]
    for out in results:
        # identical data on every rank: every aggregator returns the common gradient
        for a, b in zip(out["robust"], reference):
            assert torch.allclose(a, b, atol=1e-5)
        for attack, aggregator in ATTACKED:
            for a, b in zip(out[(attack, aggregator)], reference):
                # the Byzantine rank is outvoted: honest ranks agree, so do the results
                # (ALIE's vector equals the honest one when the honest std is 0)
                assert torch.allclose(a, b, atol=1e-5), (attack, aggregator)
        # the attack is real: allreduce averages the flipped gradient in (3/5 of it is left)
        assert not torch.allclose(out["attacked_allreduce"][0], reference[0], atol=1e-3)
        for a, b in zip(out["sent_allreduce"], out["attacked_allreduce"]):
            assert torch.equal(a, b)  # no outgoing/send: SentAttacked attacks the gradient
        for a, b, c in zip(out["robust_m"], out["nan_m"], results[0]["allreduce_m"]):
            assert torch.allclose(a, c, atol=1e-5) and torch.allclose(b, c, atol=1e-5)
        assert not torch.allclose(out["allreduce_m"][0], reference[0], atol=1e-3)
        assert out["attacker_finite"]
        assert "f=2" in out["error"] and "world size 5" in out["error"] \
            and "2f + 3 = 7" in out["error"]


def test_bad_names_list_valid_ones() -> None:
    import hexagram as hx
    from hexagram.testing.attacks import AttackConfig

    with pytest.raises(ConfigError, match="valid aggregators: median, trimmed_mean, krum"):
        hx.algorithms.get("robust", aggregator="mean")
    with pytest.raises(ConfigError, match="valid: None, nnm, bucketing"):
        hx.algorithms.get("robust", pre="clip")
    with pytest.raises(ValueError, match="valid attacks: sign_flip, scale"):
        AttackConfig(name="flip", ranks=(0,))
    cfg = hx.algorithms.get("robust").config
    assert (cfg.aggregator, cfg.f) == ("trimmed_mean", 1)
    with pytest.raises(ConfigError, match="f=1 needs at least 2f \\+ 1 = 3 vectors, got "
                                          "world size 2"):
        cfg.check_world_size(2)
