"""Checkpoints under bad input and failures: clear errors on every rank, never a partial load.

- another model / algorithm / world size, ranks on different directories: CheckpointError
  naming the mismatch on every rank, the live model untouched;
- a rank that dies while a checkpoint is written: the step is never committed, and the next
  job resumes from the previous one;
- 4 -> 3 ranks: per-rank floating-point state (error-feedback residuals) is folded into its
  mean, other per-rank state (RNG) comes from the same rank; growth that would need a
  per-rank RNG of a rank that never existed is refused naming the entry.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hexagram.launch import run_local


def _model(algorithm: str = "allreduce", hidden: int = 8, seed: int = 0,
           **config: Any) -> tuple[Any, torch.optim.Optimizer]:
    import hexagram as hx

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, hidden), nn.ReLU(), nn.Linear(hidden, 2)).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    return hx.DistributedDataParallel(net, optimizers=[opt],
                                      algorithm=hx.algorithms.get(algorithm, **config)), opt


def _train(model: Any, opt: torch.optim.Optimizer, steps: int) -> None:
    for s in range(steps):
        g = torch.Generator().manual_seed(100 * dist.get_rank() + s)
        x = torch.randn(6, 5, generator=g, dtype=torch.float64)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _expect_error(fn: Any) -> str:
    from hexagram.elastic.checkpoint import CheckpointError

    try:
        fn()
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def _bad_input_worker(root: str) -> dict[str, Any]:
    import hexagram as hx

    rank = hx.init(timeout=30).rank
    model, opt = _model()
    _train(model, opt, 3)
    hx.save_checkpoint(Path(root) / "a", model, [opt], step=3)
    other, other_opt = _model(hidden=9, seed=1)
    before = [p.clone() for p in other.parameters()]
    comp, comp_opt = _model("powersgd", seed=1)
    out = {
        "model": _expect_error(lambda: hx.load_checkpoint(Path(root) / "a", other, [other_opt])),
        "untouched": all(torch.equal(a, b) for a, b in zip(before, other.parameters())),
        "algorithm": _expect_error(lambda: hx.load_checkpoint(Path(root) / "a", comp,
                                                              [comp_opt])),
        "dirs": _expect_error(lambda: hx.load_checkpoint(Path(root) / f"r{rank}", model, [opt])),
        "empty": hx.load_checkpoint(Path(root) / "never_written", model, [opt]),
    }
    for m in (model, other, comp):
        m.close()
    return out


def test_bad_input_is_a_clear_error_on_every_rank(tmp_path: Path) -> None:
    for out in run_local(_bad_input_worker, 2, args=(str(tmp_path),), timeout=120):
        assert "another model: entry '0.weight' is ([8, 5], 'torch.float64')" in out["model"]
        assert out["untouched"]
        assert "saved with algorithm 'allreduce', this job has 'powersgd'" in out["algorithm"]
        assert "ranks point at different checkpoint directories" in out["dirs"]
        assert out["empty"] is None


def _dies_while_saving(root: str) -> Any:
    import hexagram as hx
    from hexagram.elastic import checkpoint
    from hexagram.testing.faults import FaultInjector

    rank = hx.init(timeout=5).rank
    model, opt = _model()
    _train(model, opt, 2)
    hx.save_checkpoint(root, model, [opt], step=2)
    saved = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, 2)
    # rank 1 writes its shard of step 4, then is killed before the commit
    with FaultInjector([], rank).inside(checkpoint.dcp, "save", rank=1, when="after"):
        try:
            hx.save_checkpoint(root, model, [opt], step=4)
        except Exception as exc:
            return saved, f"{type(exc).__name__}: {exc}"
    return saved, "saved"


def _resume(root: str) -> tuple[int | None, list[torch.Tensor]]:
    import hexagram as hx

    hx.init(timeout=30)
    model, opt = _model(seed=5)
    step = hx.load_checkpoint(root, model, [opt])
    return step, [p.detach().clone() for p in model.parameters()]


def test_a_checkpoint_written_while_a_rank_died_is_never_loaded(tmp_path: Path) -> None:
    first = run_local(_dies_while_saving, 2, args=(str(tmp_path),), timeout=90,
                      allow_failures=True)
    saved, outcome = first[0]
    assert outcome.startswith("CheckpointError: confirming step 4 on every rank: a peer"), outcome
    assert "exit code -9" in first[1]  # SIGKILL
    assert (tmp_path / "step_0000000004" / ".metadata").exists()  # step 4 was written...
    assert not (tmp_path / "step_0000000004" / "hexagram_commit.json").exists()  # ...uncommitted
    for step, params in run_local(_resume, 2, args=(str(tmp_path),), timeout=90):
        assert step == 2
        assert all(torch.equal(a, b) for a, b in zip(saved, params))


RESHARD = ("powersgd", "qsgd", "diloco")  # residuals + Q, per-rank RNG, outer optimizer
RESHARD_CONFIG: dict[str, dict[str, Any]] = {"powersgd": {"start_iter": 1},
                                             "local_sgd": {"period": 4}, "diloco": {"period": 4}}


def _save_on_four(root: str) -> dict[str, Any]:
    import hexagram as hx

    hx.init(timeout=30)
    saved = {}
    for name in RESHARD:
        model, opt = _model(name, **RESHARD_CONFIG.get(name, {}))
        _train(model, opt, 3)
        hx.save_checkpoint(Path(root) / name, model, [opt], step=3)
        saved[name] = copy.deepcopy(model.algorithm_state_dict())
        model.close()
    return saved


def _load_elsewhere(root: str) -> dict[str, Any]:
    import hexagram as hx
    from hexagram.elastic.checkpoint import CheckpointError

    hx.init(timeout=30)
    out: dict[str, Any] = {}
    for name in RESHARD:
        model, opt = _model(name, seed=3, **RESHARD_CONFIG.get(name, {}))
        refused = _expect_error(functools.partial(hx.load_checkpoint, Path(root) / name,
                                                  model, [opt]))
        try:
            hx.load_checkpoint(Path(root) / name, model, [opt], allow_world_size_change=True)
            state = copy.deepcopy(model.algorithm_state_dict())
            _train(model, opt, 2)  # usable afterwards
            out[name] = {"refused": refused, "state": state,
                         "finite": all(p.isfinite().all() for p in model.parameters())}
        except CheckpointError as exc:
            out[name] = {"refused": refused, "error": str(exc)}
        model.close()
    return out


def _leaves(obj: Any, path: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _leaves(val, f"{path}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in _leaves(val, f"{path}/{i}").items()}
    return {path: obj}


@pytest.mark.slow
@pytest.mark.timeout(600)  # a 4-rank and a 3-rank launch (about 1 min on an idle machine)
def test_world_size_change_folds_per_rank_state(tmp_path: Path) -> None:
    saved = run_local(_save_on_four, 4, args=(str(tmp_path),), timeout=280)
    shrunk = run_local(_load_elsewhere, 3, args=(str(tmp_path),), timeout=280)
    for name in RESHARD:
        old = [_leaves(s[name]) for s in saved]
        for rank, result in enumerate(shrunk):
            assert "saved by 4 ranks, this job has 3" in result[name]["refused"]
            assert "error" not in result[name], result[name]["error"]
            assert result[name]["finite"]
            for path, value in _leaves(result[name]["state"]).items():
                if not isinstance(value, torch.Tensor):
                    continue
                values = [o[path] for o in old]
                if all(torch.equal(v, values[0]) for v in values):
                    assert torch.equal(value, values[0]), (name, path)
                elif value.is_floating_point():  # residuals: folded into their mean
                    assert torch.equal(value, torch.stack(values).mean(0)), (name, path)
                else:  # e.g. an RNG state: the same rank's
                    assert torch.equal(value, values[rank]), (name, path)
