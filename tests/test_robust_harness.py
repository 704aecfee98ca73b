"""Attack vectors, the Dirichlet split and the ``hexagram train`` robustness options
(single process)."""

from __future__ import annotations

import argparse

import pytest
import torch

from hexagram.bench import train
from hexagram.bench.robust import dirichlet_indices, spec_fields, training_shard
from hexagram.testing.attacks import byzantine_ranks, corrupt, flip_labels


def test_attack_vectors() -> None:
    g = torch.tensor([1.0, -2.0, 0.5])
    honest = torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, 2.0]])
    assert torch.equal(corrupt("sign_flip", g), -g)
    assert torch.equal(corrupt("scale", g), -10 * g)
    assert torch.equal(corrupt("ipm", g, honest), torch.tensor([-4.0, 0.0, -4.0]))
    # ALIE: mean + 1.5 std (ddof 1): std = (sqrt 2, 0, 0)
    alie = corrupt("alie", g, honest)
    assert torch.allclose(alie, torch.tensor([2.0 + 1.5 * 2 ** 0.5, 0.0, 2.0]))
    assert torch.isnan(corrupt("nan", g)).all()
    a = corrupt("gaussian", g, generator=torch.Generator().manual_seed(1))
    b = corrupt("gaussian", g, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a, g)
    assert torch.equal(corrupt("label_flip", g), g)  # the data is poisoned, not the gradient
    assert torch.equal(flip_labels(torch.tensor([0, 3, 9]), 10), torch.tensor([9, 6, 0]))
    with pytest.raises(ValueError, match="omniscient"):
        corrupt("alie", g)
    with pytest.raises(ValueError, match="valid attacks: sign_flip, scale, gaussian"):
        corrupt("flip", g)
    assert byzantine_ranks(2, 7) == (5, 6)


def test_dirichlet_split_partitions_and_is_skewed() -> None:
    y = torch.arange(10).repeat_interleave(100)
    parts = [dirichlet_indices(y, r, 5, alpha=0.3, seed=0) for r in range(5)]
    assert sorted(torch.cat(parts).tolist()) == list(range(1000))
    shares = torch.stack([torch.bincount(y[p], minlength=10) for p in parts]).float() / 100
    assert shares.max() > 0.6  # alpha 0.3: some rank holds most of some class
    x = torch.randn(1000, 4)
    spec = {"partition": "dirichlet", "alpha": 0.3, "byzantine": 1, "attack": "label_flip"}
    shards = [training_shard(spec, x, y, 10, r, 5) for r in range(5)]
    assert {len(s[1]) for s in shards} == {200}  # same steps on every rank
    iid = {"partition": "iid", "byzantine": 1, "attack": "label_flip"}
    honest, byz = training_shard(iid, x, y, 10, 0, 5), training_shard(iid, x, y, 10, 4, 5)
    assert torch.equal(honest[1], y[0::5]) and torch.equal(byz[1], 9 - y[4::5])


def test_train_options_reach_the_spec() -> None:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--byzantine", "1", "--attack", "alie", "--partition",
                              "dirichlet"])
    assert spec_fields(args) == {"byzantine": 1, "attack": "alie", "partition": "dirichlet",
                                 "alpha": 0.3}
    with pytest.raises(ValueError, match="valid attacks"):
        spec_fields(parser.parse_args(["--attack", "evil"]))


def test_every_rank_outcome_is_kept(capsys: pytest.CaptureFixture[str]) -> None:
    from hexagram.bench.robust import FAILED_STEP, rank_outcomes, report_failed_step

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    report_failed_step(opt, rank=2)
    opt.step()  # a step that succeeds counts
    opt.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(FloatingPointError("bad")))
    with pytest.raises(FloatingPointError, match="bad"):  # re-raised as it was
        opt.step()
    assert f"{FAILED_STEP} 1 on rank 2: FloatingPointError" in capsys.readouterr().err
    ranks = [{"rank": 0, "error": "MalformedPayloadError: rank 2 sent ..."},
             {"rank": 1, "error": "NonFiniteGradientError: non-finite at step 7: ..."},
             {"rank": 3, "metric": 0.5}]
    logs = [f"noise\n{FAILED_STEP} 1 on rank 0: MalformedPayloadError\n", "", "", ""]
    out = rank_outcomes(ranks, [3, 3, None, 0], logs)
    assert [(r.get("error_class"), r.get("step"), r["exit"]) for r in out] == [
        ("MalformedPayloadError", 1, 3), ("NonFiniteGradientError", 7, 3), (None, None, None),
        (None, None, 0)]
    assert out[2]["error"] == "wrote no result" and "error" not in out[3]


def test_failure_cell_names_every_rank() -> None:
    from robust import failure_cell

    same = {"error": "x", "ranks": [{"rank": r, "exit": 3, "error_class": "E", "step": 0}
                                    for r in range(3)]}
    assert failure_cell(same) == "E, step 0, every rank (exit 3)"
    same["ranks"][1] = {"rank": 1, "exit": None, "error": "wrote no result"}
    assert failure_cell(same).split("; ")[1] == "rank 1: wrote no result, step None (exit None)"
    assert failure_cell({"error": "x"}) == "failed"
