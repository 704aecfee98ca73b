"""Relaxations inside plans: a stage's data-parallel gradient sync by any Hexagram gradient
algorithm (fp16, PowerSGD, top-k, QSGD, ...), on the stage's own ``dp`` process group.

A :class:`~hexagram.parallel.plans.StagePlan` with ``dp_algorithm="powersgd"`` (and
``dp_options={"rank": 4}``) is synchronised by :class:`StageSync`: after the stage's
backward (all micro-batches accumulated), the stage's gradients are copied into the
engine's :class:`~hexagram.buckets.Bucket` buffers and handed, bucket by bucket, to the
algorithm's ``bucket_ready`` on a :class:`~hexagram.comm.communicator.Communicator` over
the stage's ``dp`` group; the reduced buckets are written back into ``.grad`` and the
algorithm's ``after_backward`` ends its step. Compression, error feedback and warm starts
are the algorithm's own (nothing re-implemented here); its state (PowerSGD's Q, residuals)
lives in one :class:`StageSync` per stage module, kept across steps, and goes into
checkpoints by :func:`stage_state` / :func:`load_stage_state`
(``ParallelModel.algorithm_state_dict``).

What combines: tensor-parallel (DTensor) parameters are synchronised through their local
shards (each ``dp`` group holds ranks of the same ``tp`` index, hence the same shards);
parameters a ``+zero`` plan shards with FSDP2 keep FSDP's reduce-scatter (their gradients
are sharded, not whole), the algorithm syncs all others. What is refused
is :func:`~hexagram.parallel.rules.check_dp_algorithm`'s (importable from here too; its
example shows a refusal).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hexagram.algorithms import registry
from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.buckets import Bucket, build_buckets
from hexagram.comm.communicator import Communicator, Handle
from hexagram.errors import ConfigError, HexagramError
from hexagram.parallel.plans import StagePlan
from hexagram.parallel.rules import check_dp_algorithm
from hexagram.parallel.zero import fsdp_managed
from hexagram.runtime import get_runtime, is_initialized

__all__ = ["StageSync", "algorithm_sync", "check_dp_algorithm", "load_stage_state",
           "stage_state", "stage_sync"]

_MB = 1024 * 1024


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (sharing its storage), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _synced(module: nn.Module, managed: set[int]) -> list[tuple[str, nn.Parameter]]:
    """The parameters a stage's algorithm synchronises (FSDP2 keeps ``managed`` ones)."""
    return [(n, p) for n, p in module.named_parameters()
            if p.requires_grad and id(p) not in managed]


class StageSync:
    """A gradient algorithm bound to one stage module and its ``dp`` process group.

    Args:
        module: the stage's module (after sharding and ZeRO).
        group: the stage's data-parallel group.
        algorithm: a gradient algorithm (``registry.get(name, **options)``), not yet set up.
        bucket_size_mb: bucket capacity, as :class:`hexagram.DistributedDataParallel`'s.

    Call it after backward on every rank of the group (all micro-batches accumulated):
    ``sync()`` leaves the algorithm's reduced gradient in every synchronised ``.grad``.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, algorithm: Algorithm,
                 bucket_size_mb: float = 25.0) -> None:
        if not is_initialized():
            raise HexagramError("a stage's dp_algorithm runs on Hexagram's runtime: call "
                                "hexagram.init() before parallelize")
        runtime = get_runtime()
        managed = fsdp_managed(module)
        # proxies over the local shards (no copy): buckets need plain tensors
        self.params = [(n, p, nn.Parameter(_local(p).detach(), requires_grad=False))
                       for n, p in _synced(module, managed)]
        named = [(n, proxy) for n, _, proxy in self.params]
        cap = int(bucket_size_mb * _MB)
        self.buckets: list[Bucket] = build_buckets(list(reversed(named)), cap,
                                                   min(_MB, cap)) if named else []
        self.comm = Communicator(group, runtime.timeout, name=f"stage-{algorithm.name}")
        self.algorithm = algorithm
        algorithm.setup(AlgorithmContext(module, [], runtime, self.comm, named,
                                         list(self.buckets)))

    def __call__(self) -> None:
        if not self.buckets:
            return
        for _, p, proxy in self.params:
            proxy.grad = None if p.grad is None else _local(p.grad)
        handles: list[Handle[torch.Tensor] | None] = []
        for bucket in self.buckets:  # launched in order: the same on every rank
            for entry in bucket.entries:
                bucket.copy_in_grad(entry)
            handles.append(self.algorithm.bucket_ready(bucket))
        for bucket, handle in zip(self.buckets, handles):
            if handle is not None:
                bucket.copy_out_grads(handle.wait())
        self.algorithm.after_backward()
        for _, p, proxy in self.params:  # a parameter unused here still gets the mean
            if p.grad is None and not hasattr(p, "to_local"):
                p.grad = proxy.grad

    def bytes_sent(self) -> int:
        """Bytes this rank sent for the stage's sync since set-up (measured, by the comm)."""
        return self.algorithm.bytes_sent()


_SYNCS: weakref.WeakKeyDictionary[nn.Module, StageSync] = weakref.WeakKeyDictionary()
#: algorithm state loaded before the stage's first sync: applied when the sync is set up
_PENDING: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


def stage_sync(module: nn.Module) -> StageSync | None:
    """The :class:`StageSync` of a stage module once it has synchronised (else None)."""
    return _SYNCS.get(module)


def algorithm_sync(module: nn.Module, stage: StagePlan, group: dist.ProcessGroup) -> None:
    """Synchronise ``module``'s gradients over ``group`` by ``stage.dp_algorithm``.

    The drop-in for :func:`hexagram.parallel.apply.sync_gradients` (same signature): the
    first call sets the algorithm up (collective over ``group``), later calls reuse it and
    its state. ``dp_algorithm="allreduce"`` takes this path too when called directly.

    Example:
        >>> pm = parallelize(model, plan)          # a stage with dp_algorithm="powersgd"
        ... # doctest: +SKIP
        >>> pm.train_step(x, y)                    # calls algorithm_sync after backward
        ... # doctest: +SKIP
    """
    if stage.dp == 1:
        return
    sync = _SYNCS.get(module)
    if sync is None:
        check_dp_algorithm(stage.dp_algorithm, stage.dp_options)
        algorithm = registry.get(stage.dp_algorithm, **dict(stage.dp_options))
        sync = _SYNCS[module] = StageSync(module, group, algorithm)
        pending = _PENDING.pop(module, None)
        if pending is not None:  # after set-up, as hexagram's DDP loads it
            algorithm.load_state_dict(pending)
    sync()


def stage_state(module: nn.Module, stage: StagePlan) -> dict[str, Any]:
    """This rank's state of the stage's dp sync, for a checkpoint: the algorithm and its
    config, the parameters it synchronises and the algorithm's own ``state_dict()`` (step
    counter, error-feedback residuals, PowerSGD's warm-start Q, random generators; None
    before the first step, or for the built-in allreduce sync, which keeps none).

    Example:
        >>> st = StagePlan(layers=(0, 1), ranks=[0, 1], dp=2, tp=1, latency_s=0.0,
        ...                memory_bytes=0.0, dp_algorithm="powersgd", dp_options={"rank": 8})
        >>> stage_state(nn.Linear(4, 4), st)["state"] is None     # no step taken yet
        True
    """
    sync = _SYNCS.get(module)
    state = sync.algorithm.state_dict() if sync is not None else _PENDING.get(module)
    return {"dp_algorithm": stage.dp_algorithm, "dp_options": dict(stage.dp_options),
            "params": [n for n, _ in _synced(module, fsdp_managed(module))], "state": state}


def load_stage_state(module: nn.Module, stage: StagePlan, saved: Mapping[str, Any]) -> None:
    """Restore :func:`stage_state` into ``module``'s sync (before or after its first step).

    Raises:
        ConfigError: the state is of another algorithm or config, or of other parameters.
    """
    if saved["dp_algorithm"] != stage.dp_algorithm or \
            dict(saved["dp_options"]) != dict(stage.dp_options):
        theirs = ",".join(f"{k}={v}" for k, v in sorted(saved["dp_options"].items()))
        raise ConfigError(f"algorithm state of dp sync {saved['dp_algorithm']}({theirs}) "
                          f"cannot be loaded into a stage synchronised by {stage.sync_label}: "
                          f"resume with the plan that saved it")
    names = [n for n, _ in _synced(module, fsdp_managed(module))]
    if list(saved["params"]) != names:
        raise ConfigError(f"algorithm state for parameters {list(saved['params'])[:3]}... "
                          f"({len(saved['params'])}) does not fit this stage's {names[:3]}... "
                          f"({len(names)}): resume with the same plan and model")
    if saved["state"] is None:  # saved before the first step: start the algorithm afresh
        _PENDING.pop(module, None)
        old = _SYNCS.pop(module, None)
        if old is not None:
            old.algorithm.close()
        return
    sync = _SYNCS.get(module)
    if sync is not None:
        sync.algorithm.load_state_dict(dict(saved["state"]))
    else:
        _PENDING[module] = dict(saved["state"])
