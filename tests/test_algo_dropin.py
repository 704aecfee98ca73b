"""Every gradient algorithm is a drop-in for allreduce, or says why not.

One spawned 4-rank job trains a small MLP on scikit-learn digits with the user's unchanged
optimizer, ``SGD(lr=0.05, momentum=0.9)``, once per registered gradient algorithm at its
default configuration, in sequence. Each must end within 2 points of allreduce's test
accuracy, or refuse the user's setup at wrap time with a :class:`ConfigError` that names the
algorithm and what it needs instead (qadam needs its own optimizer).

The algorithms come from ``hexagram.algorithms.names()`` by property: ``kind == "grad"``
(weight-averaging algorithms have their own periods and are not drop-ins by design), less
the ones that delegate every hook to another registered algorithm (auto: what it runs is
one of the others, tested here on its own).
"""

from __future__ import annotations

from typing import Any

import pytest
from _compressed_training import Spec, _train_one  # tests/ is on sys.path under pytest

from hexagram.algorithms import registry
from hexagram.errors import ConfigError
from hexagram.launch import run_local

WORLD = 4
#: 8 epochs (88 steps per rank). Measured at 6 (one run, 4 ranks on 2 shared cores):
#: allreduce reaches only 87.1% and top-k, gTop-k, DGC end 4.0-4.7 points below it, so
#: fewer epochs would change what is tested; at 8 every algorithm is within 2 points
#: (allreduce 91.5%; closest: randomk 1.8, gtopk 1.3, dgc 1.1 below). The run time is
#: mostly fixed: spawning 4 ranks that import torch and scikit-learn, then 1.5-19 s per
#: algorithm (qsgd the slowest).
EPOCHS = 8
BATCH = 32
#: how far below allreduce's test accuracy (points) an algorithm may end
TOLERANCE = 2.0


def _delegates(name: str) -> bool:
    """The algorithm forwards its hooks to another registered algorithm (auto)."""
    return hasattr(registry.get(name), "delegate")


def dropin_names() -> list[str]:
    """Registered gradient algorithms that run their own reduction."""
    return [n for n, e in registry.entries().items() if e.kind == "grad" and not _delegates(n)]


def _train_or_refuse(names: list[str]) -> dict[str, dict[str, Any]]:
    """On this rank: train each algorithm, or record the ConfigError it refuses with."""
    import hexagram as hx

    hx.init()
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            out[name] = _train_one(Spec(name, lr=0.05, momentum=0.9), EPOCHS, BATCH)
        except ConfigError as e:
            out[name] = {"refused": str(e)}
    return out


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    per_rank = run_local(_train_or_refuse, WORLD, args=(dropin_names(),), timeout=600)
    for r in per_rank[1:]:  # every rank applied the same updates
        assert {k: v.get("digest") for k, v in r.items()} == \
            {k: v.get("digest") for k, v in per_rank[0].items()}
    for name, res in per_rank[0].items():  # shown with -s or on failure
        print(f"{name:>12}: " + (f"{res['acc']:.2f}%" if "acc" in res else res["refused"]))
    return per_rank[0]


def test_selection_is_by_property() -> None:
    names = dropin_names()
    assert "allreduce" in names and "signsgd" in names and "randomk" in names
    assert "auto" not in names and "local_sgd" not in names


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first case runs the shared 4-rank job (about 3 min idle)
@pytest.mark.parametrize("name", dropin_names())
def test_within_two_points_of_allreduce_or_says_why(
        name: str, results: dict[str, dict[str, Any]]) -> None:
    base = results["allreduce"]["acc"]
    assert base > 85.0, f"allreduce itself reached only {base:.1f}%"
    res = results[name]
    if "refused" in res:
        assert f"'{name}'" in res["refused"], res["refused"]  # names itself and the fix
        return
    assert res["acc"] >= base - TOLERANCE, \
        f"{name}: {res['acc']:.2f}% vs allreduce {base:.2f}% (SGD lr 0.05, momentum 0.9)"


def _wrap_warnings(configs: list[dict[str, Any]]) -> list[list[str]]:
    """On this rank: the warnings each signsgd config raises when wrapped."""
    import warnings

    import torch

    import hexagram as hx

    hx.init()
    out = []
    for config in configs:
        net = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = hx.DistributedDataParallel(net, optimizers=[opt],
                                               algorithm=hx.algorithms.get("signsgd", **config))
        model.close()
        out.append([str(w.message) for w in caught if issubclass(w.category, UserWarning)])
    return out


def test_pure_vote_warns_at_wrap_time_naming_the_factor() -> None:
    scaled, pure = run_local(_wrap_warnings, 1, args=([{}, {"scaled": False}],), timeout=120)[0]
    assert not [m for m in scaled if "signsgd" in m], scaled
    (message,) = [m for m in pure if "signsgd" in m]
    assert "scaled=False" in message and "0.015" in message, message
