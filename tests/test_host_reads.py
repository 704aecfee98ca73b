"""Host reads of tensor data per training step: at most one, for every algorithm.

On a GPU every ``.item()``, ``bool(t)``, ``float(t)``, ``int(t)``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``nonzero()`` (its size is data), boolean-mask indexing (a ``nonzero``
inside), ``unique`` or ``torch.tensor(host data, device=...)`` waits for the device (or
copies host data to it), so one per bucket serializes communication with backward. The
same code runs on the CPU, so counting those calls here counts the syncs the CUDA path
would make: 2 ranks on gloo, a tiny model whose largest layer passes the approximate top-k
threshold, a few warm-up steps (PowerSGD's, DGC's and QAdam's warm-ups end, ``auto``
decides), small buckets (two per step, so a read per bucket shows), then the reads of
forward, backward and optimizer step are counted step by step over two steps. The
CPU-only fast paths (numpy, decisions that read a tensor) are switched off
(:data:`hexagram.compress.packing.CPU_FAST_PATHS`) so the count covers the path CUDA takes.

Every registered algorithm is held to it, gradient and weight algorithms alike, with
periods shortened so a counted step communicates. The one read a gradient algorithm's step
may make is the engine's non-finite check at the optimizer's step pre-hook (the
algorithms' own device-side conditions join it); a weight algorithm's is its round's
control collective (the join counts, which every rank needs on the host).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from hexagram.launch import run_local

WORLD = 2
WARMUP = 3
COUNTED = 2


@dataclass(frozen=True)
class Case:
    """One counted run: ``hexagram.algorithms.get(algorithm, **config)`` under ``optimizer``
    (``"sgd"``, ``"momentum"``: SGD momentum 0.9, ``"qadam"``: its own optimizer, whose
    variance freezes before the counted steps), after ``warmup`` uncounted steps."""

    algorithm: str
    config: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "sgd"
    warmup: int = WARMUP


#: every registered algorithm (gradient and weight), warm-ups shortened so the counted
#: steps compress, and periods shortened so a counted step communicates
CASES: dict[str, Case] = {
    "allreduce": Case("allreduce"),
    "fp16": Case("fp16"),
    "bf16": Case("fp16", {"wire": "bf16"}),
    "powersgd": Case("powersgd", {"start_iter": 1}),
    "topk": Case("topk", {"density": 0.01}),
    "topk_exact": Case("topk", {"density": 0.01, "approximate": False}),
    "randomk": Case("randomk", {"density": 0.01}),
    "dgc": Case("dgc", {"density": 0.01}),
    "dgc+momentum": Case("dgc", {"density": 0.01, "clip_norm": 1.0, "masking": True},
                         "momentum"),
    "gtopk": Case("gtopk", {"density": 0.01}),
    "qsgd": Case("qsgd"),
    "terngrad": Case("terngrad"),
    "onebit": Case("onebit"),
    "efsign": Case("efsign"),
    "signsgd": Case("signsgd"),
    "bytegrad": Case("bytegrad"),
    "topk+fp16": Case("topk", {"cast": "fp16"}),
    "topk+delay": Case("topk", {"density": 0.01, "delay": 1}),
    "decoupled_momentum": Case("decoupled_momentum", {}, "momentum"),
    "qadam": Case("qadam", {}, "qadam"),
    "qadam+fp16": Case("qadam", {"compressor": "fp16"}, "qadam"),
    "robust": Case("robust", {"f": 0}, "momentum"),
    "robust+median": Case("robust", {"aggregator": "median", "f": 0, "compressor": "minmax8"}),
    "auto": Case("auto", {"candidates": ["allreduce", "topk"], "probe_budget_s": 0.1,
                          "verbose": False}, warmup=12),
    "decentralized": Case("decentralized"),
    "decentralized+ring": Case("decentralized", {"peers": "ring"}),
    "low_precision_decentralized": Case("low_precision_decentralized"),
    "local_sgd": Case("local_sgd", {"period": 2}),
    "diloco": Case("diloco", {"period": 2}),
    "sparseloco": Case("sparseloco", {"period": 2}),
    "async": Case("async", {"interval_ms": 500.0}),  # its thread reads once a round
}

_READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy",
          "nonzero", "masked_select", "unique")
_TORCH_READS = ("tensor", "nonzero", "masked_select", "unique")
#: indexing with a boolean mask (a ``nonzero`` inside, its size is data)
_MASKED = ("__getitem__", "__setitem__")


def _has_mask(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool and p.dim() > 0
               for p in parts)


class _Net(nn.Module):
    """Two layers; the first (40 000 weights) passes approximate top-k's sample threshold."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(200, 200)
        self.b = nn.Linear(200, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class _Counter:
    """Counts calls of the host-read methods of ``torch.Tensor`` (and ``torch.tensor``)
    while ``on``; keeps where each came from."""

    def __init__(self) -> None:
        self.on = False
        self.step = 0  # the step the reads are counted against
        self.sites: list[str] = []
        self.steps: list[int] = []
        self.saved: dict[tuple[Any, str], Any] = {}

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        self.saved[(owner, name)] = original

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.on and (name not in _MASKED or _has_mask(args[1])):
                self.on = False  # reads made while recording this one are not counted
                try:
                    frame = traceback.extract_stack(limit=2)[0]
                    self.sites.append(f"{name} at {frame.filename}:{frame.lineno}")
                    self.steps.append(self.step)
                finally:
                    self.on = True
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    def install(self) -> None:
        for name in _READS + _MASKED:
            self._wrap(torch.Tensor, name)
        for name in _TORCH_READS:
            self._wrap(torch, name)

    def uninstall(self) -> None:
        for (owner, name), original in self.saved.items():
            setattr(owner, name, original)


def _optimizer(kind: str, net: nn.Module) -> torch.optim.Optimizer:
    from hexagram.optim import QAdamOptimizer

    if kind == "qadam":
        return QAdamOptimizer(net.parameters(), lr=1e-3, warmup_steps=2)
    return torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9 if kind == "momentum" else 0)


def _count(case: Case, attack: str | None = None) -> tuple[list[list[str]], int]:
    """Per counted step, the host reads made (their sites); and the number of buckets.
    ``attack``: the last rank sends that attack's vector instead of its own (``robust``)."""
    import warnings

    import hexagram as hx
    from hexagram.bench.robust import SentAttacked
    from hexagram.compress import packing
    from hexagram.testing.attacks import AttackConfig

    packing.CPU_FAST_PATHS = False
    torch.manual_seed(0)
    net = _Net()
    opt = _optimizer(case.optimizer, net)
    algorithm = hx.algorithms.get(case.algorithm, **case.config)
    if attack is not None:
        last = hx.get_runtime().world_size - 1
        algorithm = SentAttacked(algorithm, AttackConfig(name=attack, ranks=(last,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # momentum taken over, lr notes
        model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algorithm,
                                           bucket_size_mb=0.1, first_bucket_mb=0.004)
    gen = torch.Generator().manual_seed(hx.get_runtime().rank)
    counter = _Counter()
    counter.install()
    try:
        for step in range(case.warmup + COUNTED):
            x = torch.randn(16, 200, generator=gen)
            counter.step = step - case.warmup
            counter.on = step >= case.warmup
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            counter.on = False
    finally:
        counter.uninstall()
        buckets = len(model.buckets)
        model.close()
    per_step = [[s for s, k in zip(counter.sites, counter.steps) if k == i]
                for i in range(COUNTED)]
    return per_step, buckets


def _nan_error(name: str, config: dict[str, Any]) -> str:
    """Two steps, rank 0's input NaN at step 1: the error each rank raised ("" if none)."""
    import hexagram as hx

    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(name, **config),
                                       bucket_size_mb=0.1, first_bucket_mb=0.004)
    error = ""
    try:
        for step in range(2):
            x = torch.randn(16, 200)
            if step == 1 and hx.get_runtime().rank == 0:
                x[0, 0] = float("nan")
            try:  # the engine reads its once-per-step check at the optimizer step
                model(x).square().mean().backward()
                opt.step()
            except hx.NonFiniteGradientError as exc:
                error = str(exc)
            opt.zero_grad()
    finally:
        model.close()
    return error


def _no_optimizers(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """Wrapped without ``optimizers=``: reads counted at step 3, rank 1's input NaN at
    steps 2 and 4, the optimizer attached after step 3. Per step: where the error came
    from ("backward" or "step") and its message ("" if none)."""
    import hexagram as hx

    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = hx.DistributedDataParallel(net, algorithm=hx.algorithms.get(name, **config),
                                       bucket_size_mb=0.1, first_bucket_mb=0.004)
    counter, errors = _Counter(), []
    counter.install()
    try:
        for step in range(5):
            if step == 4:
                model.attach_optimizers(opt)  # the read moves to the optimizer step
            x = torch.randn(16, 200)
            x[0, 0] = float("nan") if step in (2, 4) and hx.get_runtime().rank == 1 else 0.0
            where = "backward"
            counter.on = step == 3  # after the first-step re-bucketing
            try:
                model(x).square().mean().backward()
                where = "step"
                opt.step()
                errors.append(("", ""))
            except hx.NonFiniteGradientError as exc:
                errors.append((where, str(exc)))
            counter.on = False
            opt.zero_grad()
    finally:
        counter.uninstall()
        model.close()
    return {"sites": counter.sites, "errors": errors}


def _worker() -> dict[str, Any]:
    import hexagram as hx
    from hexagram.compress import packing

    hx.init()
    out: dict[str, Any] = {name: _count(case) for name, case in CASES.items()}
    packing.CPU_FAST_PATHS = False
    out["nan"] = {name: _nan_error(name, config) for name, config in NAN_CASES.items()}
    out["no_opt"] = {"topk": _no_optimizers("topk", {"density": 0.01}),
                     "topk+fp16": _no_optimizers("topk", {"density": 0.01, "cast": "fp16"})}
    return out


#: the pure vote would hide a NaN (a sign bit); qsgd's norms would carry it to every rank:
#: the engine checks the gradients before either compresses
NAN_CASES: dict[str, dict[str, Any]] = {"signsgd": {"scaled": False}, "qsgd": {}}


#: ``robust`` with the aggregators and pre-aggregations that need the Gram matrix, on
#: :data:`ROBUST_WORLD` ranks (Krum needs ``2f + 3``), with the last rank sending NaN where
#: named (its row is then excluded on the device, no read): name -> (case, attack)
ROBUST_WORLD = 3
ROBUST_CASES: dict[str, tuple[Case, str | None]] = {
    "krum": (Case("robust", {"aggregator": "krum", "f": 0}, "momentum"), None),
    "krum+nan": (Case("robust", {"aggregator": "krum", "f": 0}, "momentum"), "nan"),
    "multikrum+nan": (Case("robust", {"aggregator": "multikrum", "f": 0}), "nan"),
    "geomed": (Case("robust", {"aggregator": "geomed", "f": 1}), "nan"),
    "centered_clip": (Case("robust", {"aggregator": "centered_clip", "f": 1}, "momentum"),
                      "nan"),
    "nnm": (Case("robust", {"aggregator": "trimmed_mean", "f": 1, "pre": "nnm"}), "nan"),
    "bucketing": (Case("robust", {"aggregator": "geomed", "f": 0, "pre": "bucketing"}),
                  "nan"),
    "krum+nnm+minmax8": (Case("robust", {"aggregator": "krum", "f": 0, "pre": "nnm",
                                         "compressor": "minmax8"}), None),
}


def _robust_worker() -> dict[str, Any]:
    import hexagram as hx

    hx.init()
    return {name: _count(case, attack) for name, (case, attack) in ROBUST_CASES.items()}


@pytest.fixture(scope="module")
def reads() -> list[dict[str, Any]]:
    return run_local(_worker, WORLD, timeout=600)


@pytest.fixture(scope="module")
def robust_reads() -> list[dict[str, Any]]:
    return run_local(_robust_worker, ROBUST_WORLD, timeout=600)


@pytest.mark.parametrize("name", list(ROBUST_CASES))
def test_robust_reads_at_most_once_per_step(name: str, robust_reads: list[dict[str, Any]]
                                            ) -> None:
    # the distance-based aggregators and pre-aggregation once read the finite rows per
    # bucket (a nonzero and the lowered f): now masked on the device, NaN rows included
    for rank, per_rank in enumerate(robust_reads):
        per_step, buckets = per_rank[name]
        assert buckets >= 2, "the model must span several buckets for the count to mean much"
        for step, sites in enumerate(per_step):
            assert len(sites) <= 1, (
                f"robust {name} on rank {rank}, counted step {step}: {len(sites)} host "
                "reads:\n" + "\n".join(sites))


@pytest.mark.parametrize("name", list(CASES))
def test_at_most_one_host_read_per_step(name: str, reads: list[dict[str, Any]]) -> None:
    for rank, per_rank in enumerate(reads):
        per_step, buckets = per_rank[name]
        assert buckets >= 2, "the model must span several buckets for the count to mean much"
        for step, sites in enumerate(per_step):
            assert len(sites) <= 1, (
                f"{name} on rank {rank}, counted step {step}: {len(sites)} host reads:\n"
                + "\n".join(sites))


def test_nan_is_caught_once_per_step_where_the_compressed_form_hides_it(
        reads: list[dict[str, Any]]) -> None:
    hidden = reads[0]["nan"]["signsgd"]
    assert "step 1" in hidden and "parameter 'b." in hidden and "NaN" in hidden, hidden


def test_nan_is_named_on_its_rank_and_stops_every_rank(
        reads: list[dict[str, Any]]) -> None:
    # the engine makes the bucket finite before qsgd compresses it: the rank that saw the
    # NaN raises naming it; the others raise at the same step, naming another rank (the
    # flag is shared once per step), and no NaN reaches any optimizer
    message = reads[0]["nan"]["qsgd"]
    assert "step 1" in message and "NaN" in message and "parameter '" in message, message
    for rank in range(1, WORLD):
        other = reads[rank]["nan"]["qsgd"]
        assert "step 1" in other and "another rank" in other, other


@pytest.mark.parametrize("name", ["topk", "topk+fp16"])
def test_without_optimizers_the_check_runs_at_the_end_of_backward(
        name: str, reads: list[dict[str, Any]]) -> None:
    # no optimizer step to hook: the engine's once-per-step read moves to the end of
    # backward (before, the bucket was made finite and nothing raised on any rank)
    for rank in range(WORLD):
        run = reads[rank]["no_opt"][name]
        assert len(run["sites"]) <= 1, "\n".join(run["sites"])
        errors = run["errors"]
        assert errors[0] == errors[1] == errors[3] == ("", "")
        if rank != 1:  # the flag is shared: every rank raises at the same step
            assert [e[0] for e in (errors[2], errors[4])] == ["backward", "step"], errors
            assert "step 2" in errors[2][1] and "another rank" in errors[2][1], errors
            assert "step 4" in errors[4][1] and "another rank" in errors[4][1], errors
            continue
        named = tuple(f"parameter '{n}'" for n, _ in _Net().named_parameters())
        where, message = errors[2]
        assert where == "backward" and "step 2" in message \
            and any(n in message for n in named), errors[2]
        where, message = errors[4]  # attach_optimizers: read at opt.step() from then on
        assert where == "step" and "step 4" in message \
            and any(n in message for n in named), errors[4]


def test_the_counter_sees_reads() -> None:
    counter = _Counter()
    counter.install()
    try:
        counter.on = True
        t = torch.ones(3)
        _ = t.sum().item(), bool(t[0]), float(t[1]), t.tolist(), torch.tensor([1.0])
        _ = t.nonzero(), torch.nonzero(t)
        _ = t[t > 1], t[1:], t[torch.tensor(0)]
        t[t > 1] = 0.0
    finally:
        counter.on = False
        counter.uninstall()
    assert [s.split()[0] for s in counter.sites] == [
        "item", "__bool__", "__float__", "tolist", "tensor", "nonzero", "nonzero",
        "__getitem__", "tensor", "__setitem__"]
    assert torch.Tensor.item.__name__ == "item"  # uninstalled
