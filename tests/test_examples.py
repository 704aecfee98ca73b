"""Every capability's example in ``examples/`` runs, at tiny sizes: in this process as a
world of one (no launcher), and the two that need several ranks (robust aggregation
against an attacker, a planned model) on local ranks through ``hexagram.launch.run_local``.

The GPT-2 framework examples run under torchrun in ``test_integrations_examples.py``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from hexagram import runtime
from hexagram.launch import run_local

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def examples(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ModuleType]:
    """``examples`` as a package on ``sys.path`` (ranks started by run_local inherit it),
    the working directory a temporary one; the process group is gone afterwards."""
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(tmp_path)
    package = importlib.import_module("examples")
    assert Path(next(iter(package.__path__))) == ROOT / "examples", package.__path__
    yield package
    if runtime.is_initialized():
        runtime.shutdown()


def _load(name: str) -> ModuleType:
    return importlib.import_module(f"examples.{name}")


def test_every_capability_has_an_example() -> None:
    names = {p.stem for p in (ROOT / "examples").glob("*.py")}
    assert {"auto", "compression", "local_sgd", "async_averaging", "robust",
            "elastic_restart", "planner", "simulate"} <= names


def test_auto(examples: ModuleType) -> None:
    result = _load("auto").main(["--steps", "4"])
    assert result["chosen"] == "allreduce" and math.isfinite(result["loss"])  # one rank


def test_compression_and_wrappers(examples: ModuleType) -> None:
    results = _load("compression").main(["--steps", "3"])
    assert set(results) == {"allreduce", "powersgd", "powersgd:cast=bf16",
                            "qsgd:error_feedback=true", "topk", "powersgd:delay=1"}
    assert all(math.isfinite(r["loss"]) for r in results.values())


@pytest.mark.parametrize("algorithm", ["local_sgd", "diloco"])
def test_local_sgd_and_diloco(examples: ModuleType, algorithm: str) -> None:
    result = _load("local_sgd").main(["--algorithm", algorithm, "--steps", "6",
                                      "--period", "3"])
    assert result["replica_spread"] == 0.0 and math.isfinite(result["loss"])


def test_async_averaging(examples: ModuleType) -> None:
    assert math.isfinite(_load("async_averaging").main(["--steps", "4"])["loss"])


def test_elastic_restart_resumes_from_the_checkpoint(examples: ModuleType) -> None:
    module = _load("elastic_restart")
    argv = ["--steps", "8", "--every", "3", "--dir", "ckpt"]
    with pytest.raises(SystemExit, match="simulated failure at step 7"):
        module.main([*argv, "--crash-at", "7"])
    runtime.shutdown()  # the "dead" process's group; the restart makes a new one
    assert module.main([*argv, "--crash-at", "7"])["start"] == 6  # last commit: step 6


def test_simulate(examples: ModuleType) -> None:
    best = _load("simulate").main(["--world", "8,64"])
    assert set(best) == {8, 64} and best[64] != "allreduce"  # 25 Gbit/s between hosts


@pytest.mark.timeout(240)
def test_robust_trains_through_an_attacker(examples: ModuleType) -> None:
    main = _load("robust").main
    robust = run_local(main, 3, args=(["--steps", "40"],), timeout=200)
    mean = run_local(main, 3, args=(["--steps", "40", "--algorithm", "allreduce"],),
                     timeout=200)
    assert robust[0]["accuracy"] > 0.4 > mean[0]["accuracy"], (robust, mean)


@pytest.mark.timeout(240)
def test_planner_plans_and_trains_on_two_ranks(examples: ModuleType) -> None:
    pytest.importorskip("highspy", reason="needs the planner extra")
    results = run_local(_load("planner").main, 2, args=(["--steps", "3"],), timeout=200)
    assert "Plan for 1x2 devices" in results[0]["plan"]
    assert all(math.isfinite(r["last_loss"]) for r in results)
