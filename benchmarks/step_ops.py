"""Aten ops a wrapper adds to two training steps, per algorithm, next to torch DDP.

Every op costs host time in the dispatcher, and every op that computes is a kernel launch
on a GPU (about 8 us of host time), so the ops a wrapper adds to a step bound how close to
torch DDP its step can come on a fast link. For each
registered algorithm and for ``torch.nn.parallel.DistributedDataParallel`` this counts the
ops of two steady training steps of the wrapped model, less those of the same two steps
of the plain model (same optimizer, same inputs): the wrapper's own per-step work.

Set-up: world 1 (gloo, one spawned process), a model of 128 parameter tensors (64
``Linear(32, 32)``), one bucket (large ``bucket_size_mb`` and ``first_bucket_mb``), SGD
(momentum 0.9 for ``decoupled_momentum``; QAdam's own optimizer for ``qadam``), batch 8.
Warm-up steps end every algorithm's warm-up (PowerSGD ``start_iter=1``, DGC
``warmup_steps=0``, QAdam's optimizer ``warmup_steps=1``); the weight algorithms run with
period (interval) 1 or 2, so each communicates at least once in the two counted steps.

Counting rule (the same for every setup): a ``TorchDispatchMode`` counts every op that
reaches the dispatcher's Python key, that is each op the Python code (or a composite op's
decomposition, e.g. ``aten::to`` -> ``aten::_to_copy``) dispatches, collectives (``c10d::``)
included. Ops called inside another op's kernel are not counted (the mode is off while
its handler runs the op). Ops of the training thread count, and so do those of jobs the
library hands to thread pools during the counted steps (the communicator's issuing
thread); a free-running background thread (``async``) does not.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/step_ops.py`` (prints the table;
``--json PATH`` writes it too). ``tests/test_step_ops.py`` holds every algorithm to at
most torch DDP's count + 400.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures.thread as cf_thread
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CONFIGS", "DDP", "OpCounter", "count_all", "format_table", "main"]

LAYERS, WIDTH, BATCH = 64, 32, 8  # 64 x (weight, bias): 128 parameter tensors
WARMUP, COUNTED = 4, 2
DDP = "torch DDP"
HUGE_MB = 1024.0  # one bucket for the whole model

#: algorithm -> config overrides (warm-ups shortened, a communicating step in the count)
CONFIGS: dict[str, dict[str, Any]] = {
    "powersgd": {"start_iter": 1},
    "dgc": {"warmup_steps": 0},
    "decentralized": {"interval": 1},
    "low_precision_decentralized": {"interval": 1},
    "local_sgd": {"period": 2},
    "diloco": {"period": 2},
    "sparseloco": {"period": 2},
    "robust": {"f": 0},
    "auto": {"verbose": False},
}


class _Mode(TorchDispatchMode):
    """Adds one to its counter for each op dispatched while it is on this thread's stack."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.counter.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


class OpCounter:
    """Counts dispatched ops by name, on this thread and in thread-pool jobs while on.

    Example:
        >>> counter = OpCounter()
        >>> with counter.counting():
        ...     _ = torch.ones(3) + 1
        >>> counter.total() >= 2
        True
    """

    def __init__(self) -> None:
        self.ops: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # ops of the pool threads arrive concurrently
        self._on = False

    def add(self, name: str) -> None:
        with self._lock:
            self.ops[name] += 1

    def total(self) -> int:
        return sum(self.ops.values())

    @contextlib.contextmanager
    def counting(self) -> Iterator[OpCounter]:
        """Count this thread's ops, and those of every thread-pool job started meanwhile
        (the mode stack is per thread: each job pushes a mode of its own)."""
        original = cf_thread._WorkItem.run
        counter = self

        def run(item: Any, *args: Any, **kwargs: Any) -> Any:
            if not counter._on:
                return original(item, *args, **kwargs)
            with _Mode(counter):
                return original(item, *args, **kwargs)

        cf_thread._WorkItem.run = run  # type: ignore[method-assign,assignment]
        self._on = True
        try:
            with _Mode(self):
                yield self
        finally:
            self._on = False
            cf_thread._WorkItem.run = original  # type: ignore[method-assign]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "qadam":
        from hexagram.optim.qadam import QAdamOptimizer

        return QAdamOptimizer(params, lr=1e-3, warmup_steps=1)
    momentum = 0.9 if name == "decoupled_momentum" else 0.0
    return torch.optim.SGD(params, lr=0.01, momentum=momentum)


def _wrap(name: str, net: nn.Module, opt: torch.optim.Optimizer) -> nn.Module | None:
    """``net`` wrapped for ``name`` (None: the plain model)."""
    import hexagram as hx

    if name == DDP:
        return nn.parallel.DistributedDataParallel(net, bucket_cap_mb=HUGE_MB)
    if name == "":
        return None
    algorithm = hx.algorithms.get(name, **CONFIGS.get(name, {}))
    return hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algorithm,
                                      bucket_size_mb=HUGE_MB, first_bucket_mb=HUGE_MB)


def _buckets(wrapped: nn.Module | None) -> int:
    """Buckets of the last step (torch DDP: from its logging data, after its rebuild)."""
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        data = wrapped._get_ddp_logging_data()
        return len(str(data.get("rebuilt_bucket_sizes", data["bucket_sizes"])).split(","))
    return len(getattr(wrapped, "buckets", []))


def _run(name: str, optimizer_of: str) -> tuple[collections.Counter[str], int]:
    """Ops of the counted steps of ``name`` ("" = no wrapper) and its bucket count."""
    net = _model()
    opt = _optimizer(optimizer_of, net.parameters())
    wrapped = _wrap(name, net, opt)
    model = net if wrapped is None else wrapped
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(BATCH, WIDTH, generator=gen) for _ in range(WARMUP + COUNTED)]
    counter = OpCounter()
    try:
        for step, x in enumerate(xs):
            with counter.counting() if step >= WARMUP else contextlib.nullcontext():
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        buckets = _buckets(wrapped)
    finally:
        close = getattr(wrapped, "close", None)
        if callable(close):
            close()
    return counter.ops, buckets


def _optimizer_kind(name: str) -> str:
    """Setups with the same kind train with the same optimizer: one plain count serves all."""
    return name if name in ("qadam", "decoupled_momentum") else "sgd"


def _added(name: str, plains: dict[str, collections.Counter[str]]) -> dict[str, Any]:
    """One row: ops ``name`` adds to the counted steps and the ops that grew most;
    ``plains`` caches the plain model's counts per optimizer kind."""
    kind = _optimizer_kind(name)
    try:
        wrapped, buckets = _run(name, kind)
        if kind not in plains:
            plains[kind] = _run("", kind)[0]
    except Exception as exc:  # reported in its row; the test fails it by name
        return {"error": f"{type(exc).__name__}: {exc}"}
    plain = plains[kind]
    grew = (wrapped - plain).most_common(6)
    return {"added": wrapped.total() - plain.total(), "wrapped": wrapped.total(),
            "plain": plain.total(), "buckets": buckets, "top": grew}


def count_all(names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Rows for torch DDP and ``names`` (default: every registered algorithm); run it on a
    world-1 rank (``hexagram.launch.run_local(count_all, 1)``)."""
    import hexagram as hx

    hx.init(backend="gloo")
    names = hx.algorithms.names() if names is None else names
    plains: dict[str, collections.Counter[str]] = {}
    return {name: _added(name, plains) for name in [DDP, *names]}


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    """Markdown table: setup, ops added in two steps, x torch DDP, the ops that grew most."""
    ddp = rows.get(DDP, {}).get("added")
    lines = [f"| setup | ops added ({COUNTED} steps) | x torch DDP | most added |",
             "|---|---:|---:|---|"]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | failed: {row['error']} | | |")
            continue
        ratio = f"{row['added'] / ddp:.2f}" if ddp else "-"
        top = ", ".join(f"{op} {n}" for op, n in row["top"][:4])
        lines.append(f"| {name} | {row['added']:,} | {ratio} | {top} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table (and write ``--json``); returns 0."""
    from hexagram.launch import run_local

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--algorithms", help="comma-separated subset (default: all)")
    ns = parser.parse_args(argv)
    names = ns.algorithms.split(",") if ns.algorithms else None
    rows = run_local(count_all, 1, args=(names,), timeout=600)[0]
    print(format_table(rows))
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
