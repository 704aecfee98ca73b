"""Automatic model parallelism (the Alpa idea) on PyTorch's own engine.

``plan`` captures a model with torch.fx, chooses per-operator sharding with an ILP (HiGHS)
and pipeline stages with Alpa's dynamic programming, all from a cost model of the
:class:`Cluster`; ``parallelize`` applies the plan with DTensor / ``parallelize_module`` and
``torch.distributed.pipelining``.

Example:
    >>> import torch, hexagram.parallel as hp
    >>> model = hp.gpt(layers=2, hidden=64, heads=4, vocab=100, seq=16, device="meta")
    >>> p = hp.plan(model, torch.zeros(8, 16, dtype=torch.long, device="meta"),
    ...             cluster=hp.Cluster(hosts=1, devices_per_host=2))
    >>> p.devices
    2
    >>> dist_model = hp.parallelize(model, p)   # on the ranks torchrun started  # doctest: +SKIP
"""

from hexagram.parallel.apply import (
    apply_pipeline,
    apply_sharding,
    apply_stage,
    default_loss,
    parallelize,
    sync_gradients,
)
from hexagram.parallel.auto import auto, measure_cluster
from hexagram.parallel.baselines import Baseline, baselines, evaluate_fixed
from hexagram.parallel.cluster import Cluster, Constraints, Submesh
from hexagram.parallel.graph import ModelGraph, capture
from hexagram.parallel.models import gpt, mlp_stack
from hexagram.parallel.planner import NoPlanFitsError, plan, plan_graph
from hexagram.parallel.plans import Plan, StagePlan
from hexagram.parallel.reprice import breakdown, price, stage_latencies
from hexagram.parallel.runner import ParallelModel

__all__ = [
    "Baseline",
    "Cluster",
    "Constraints",
    "ModelGraph",
    "NoPlanFitsError",
    "ParallelModel",
    "Plan",
    "StagePlan",
    "Submesh",
    "apply_pipeline",
    "apply_sharding",
    "apply_stage",
    "auto",
    "baselines",
    "breakdown",
    "capture",
    "default_loss",
    "evaluate_fixed",
    "gpt",
    "measure_cluster",
    "mlp_stack",
    "parallelize",
    "plan",
    "plan_graph",
    "price",
    "stage_latencies",
    "sync_gradients",
]
