"""The planner's output: a declarative, printable, JSON-serialisable plan.

A :class:`Plan` lists pipeline stages; each stage holds a contiguous range of layers, the
global ranks of its submesh, its ``dp x tp`` shape and, per ``nn.Linear``, its sharding
(``colwise``, ``rowwise`` or ``replicate``; ``+zero`` when parameters are ZeRO-sharded over
``dp``) with the activation layouts the executor must hand over (``R`` / ``S``). It is
applied by the separate ``apply_*`` steps of :mod:`hexagram.parallel.apply`.

Example:
    >>> from hexagram.parallel.cluster import Cluster
    >>> st = StagePlan(layers=(0, 2), ranks=[0, 1], dp=1, tp=2, latency_s=0.01,
    ...                memory_bytes=1e9, shardings={"1.fc1": "colwise"})
    >>> p = Plan(cluster=Cluster(hosts=1, devices_per_host=2), stages=[st], microbatches=1,
    ...          global_batch=8, step_time_s=0.01)
    >>> Plan.from_json(p.to_json()) == p
    True
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from hexagram.parallel.cluster import Cluster
from hexagram.parallel.rules import DP_BUCKET_BYTES, check_dp_algorithm

__all__ = ["DP_BUCKET_BYTES", "Plan", "StagePlan"]


@dataclass
class StagePlan:
    """One pipeline stage.

    Attributes:
        layers: ``[start, end)`` indices of the model's layers (top-level children).
        ranks: global ranks of the stage's devices, ``dp``-major (``tp`` ranks adjacent).
        dp, tp: data- and tensor-parallel degrees inside the stage (``dp * tp`` devices).
        latency_s: predicted forward + backward seconds of one micro-batch (incl. transfer
            to the next stage and gradient sync amortised over micro-batches).
        memory_bytes: predicted peak bytes per device.
        shardings: ``nn.Linear`` module path -> ``colwise|rowwise|replicate[+zero]``.
        layouts: module path -> (layout it receives, layout it hands on): ``"R"``/``"S"``.
        sharded_ops: non-linear operators run on sharded (``S``) activations, for display.
        dp_algorithm: the Hexagram gradient algorithm that synchronises the stage's
            gradients over its ``dp`` ranks (``hexagram.algorithms.names()``); ``"allreduce"``
            (default) is the exact average, ``"fp16"`` / ``"powersgd"`` / ``"topk"`` send
            fewer bytes (see :mod:`hexagram.parallel.relax`).
        dp_options: that algorithm's config (e.g. ``{"rank": 4}`` for PowerSGD).
    """

    layers: tuple[int, int]
    ranks: list[int]
    dp: int
    tp: int
    latency_s: float
    memory_bytes: float
    shardings: dict[str, str] = field(default_factory=dict)
    layouts: dict[str, tuple[str, str]] = field(default_factory=dict)
    sharded_ops: int = 0
    dp_algorithm: str = "allreduce"
    dp_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dp_algorithm != "allreduce" or self.dp_options:
            check_dp_algorithm(self.dp_algorithm, self.dp_options)

    @property
    def sync_label(self) -> str:
        """``powersgd(rank=4)``: the stage's dp sync, for display."""
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.dp_options.items()))
        return f"{self.dp_algorithm}({opts})" if opts else self.dp_algorithm


@dataclass
class Plan:
    """A complete parallel plan; ``print(plan)`` shows it, ``to_json`` stores it."""

    cluster: Cluster
    stages: list[StagePlan]
    microbatches: int
    global_batch: int
    step_time_s: float
    schedule: str = "1f1b"
    layer_names: list[str] = field(default_factory=list)
    unknown_ops: list[str] = field(default_factory=list)
    params: int = 0
    #: reshardings the executor cannot place (apply refuses the plan; planning still valid)
    blockers: list[str] = field(default_factory=list)

    @property
    def memory_bytes(self) -> float:
        """Peak predicted bytes on any device."""
        return max(s.memory_bytes for s in self.stages)

    @property
    def devices(self) -> int:
        return sum(len(s.ranks) for s in self.stages)

    def summary(self) -> str:
        """One line: ``pp x (dp x tp)`` shapes, micro-batches, predicted time and memory."""
        shapes = "+".join(f"{s.dp}x{s.tp}" for s in self.stages)
        return (f"{len(self.stages)} stage(s) [{shapes} dp x tp], {self.microbatches} "
                f"micro-batch(es) {self.schedule}: {self.step_time_s * 1e3:.2f} ms/step, "
                f"{self.memory_bytes / 1e9:.2f} GB/device")

    def __str__(self) -> str:
        c = self.cluster
        lines = [f"Plan for {c.hosts}x{c.devices_per_host} devices "
                 f"({c.device_memory_gb:g} GB each), {self.params / 1e6:.1f}M parameters, "
                 f"global batch {self.global_batch}", "  " + self.summary()]
        for i, s in enumerate(self.stages):
            kinds: dict[str, int] = {}
            for style in s.shardings.values():
                kinds[style] = kinds.get(style, 0) + 1
            names = self.layer_names[s.layers[0]:s.layers[1]]
            span = f"{names[0]}..{names[-1]}" if names else f"{s.layers[0]}..{s.layers[1] - 1}"
            lines.append(f"  stage {i}: layers {span} ({s.layers[1] - s.layers[0]}) on ranks "
                         f"{s.ranks[0]}-{s.ranks[-1]} as dp={s.dp} x tp={s.tp}; "
                         f"{s.latency_s * 1e3:.3f} ms/micro-batch, "
                         f"{s.memory_bytes / 1e9:.2f} GB; linears "
                         + ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items()))
                         + (f"; dp sync {s.sync_label}" if s.dp_algorithm != "allreduce"
                            else ""))
        if self.unknown_ops:
            lines.append(f"  replicated unknown operators: {', '.join(self.unknown_ops)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json` (validates the cluster again)."""
        raw = json.loads(text)
        stages = [StagePlan(**{**s, "layers": tuple(s["layers"]),
                               "layouts": {k: tuple(v) for k, v in s["layouts"].items()}})
                  for s in raw.pop("stages")]
        return cls(cluster=Cluster(**raw.pop("cluster")), stages=stages, **raw)
