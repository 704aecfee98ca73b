"""Simulated step time of every algorithm on clusters one does not have (``hexagram simulate``).

Nothing here times anything: a model's gradient layout (a registered model or a module built
on the ``meta`` device, or ``params`` split into equal layers), a compute profile derived
from a device's datasheet (:mod:`hexagram.cost.devices`) or measured on this machine
(:func:`hexagram.cost.profile.profile_module`), and a :class:`~hexagram.cost.probe.NetworkProfile`
built from link presets instead of a probe are handed to the step-time model
(:func:`hexagram.cost.model.predict_any`), which runs the schedules of
:mod:`hexagram.cost.schedule`. So ``simulate`` predicts exactly what ``advise`` would predict
had it probed the same network.

The cluster (:class:`~hexagram.cost.cluster.Cluster`, re-exported here: a view of the one
hardware description, :class:`~hexagram.cost.hardware.Hardware`) gives the network of
``P = hosts x d`` ranks (intra link ``a``, inter link ``e`` with rate
``B_e = links x rate / oversubscription`` per host), which times each message with the
schedule the backend really runs for its size (:mod:`hexagram.cost.collectives`): NCCL's faster of
ring and double binary tree for allreduce (so large-P latency grows with ``log2 H``, not
``2 (P-1)``), rings for allgather, the all-to-all's uplink share, hierarchical allreduce
around the leaders' allreduce, gTop-k's butterfly (its cross-host rounds share the uplink
among the host's ``d`` ranks) and the decentralized neighbour exchange.

Labels become algorithms through ``make`` (the registry's,
:func:`hexagram.algorithms.labels.simulable`, which :func:`hexagram.auto.simulate.simulate`
and ``hexagram simulate`` pass): this module prices what it is given
(:class:`hexagram.cost.facts.Priced`) and imports no algorithm.

Example:
    >>> from hexagram.algorithms.labels import simulable
    >>> rows = simulate(["allreduce", "fp16"], [8, 64], params_compute(10_000_000),
    ...                 Cluster(devices_per_host=8, inter="25gbe"), make=simulable)
    >>> [(r.label, r.world) for r in rows]
    [('allreduce', 8), ('fp16', 8), ('allreduce', 64), ('fp16', 64)]
    >>> rows[3].bytes < rows[2].bytes
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hexagram.cost.cluster import Cluster, ClusterNetwork, ScheduleFit
from hexagram.cost.devices import EFFICIENCY, Device, device
from hexagram.cost.facts import Priced
from hexagram.cost.labels import applicable
from hexagram.cost.model import MB, predict_any
from hexagram.cost.profile import CompressorCost, ComputeProfile
from hexagram.cost.schedule import Message, TensorSpec, analytic_payloads, is_lossy
from hexagram.errors import ConfigError

__all__ = ["Cluster", "ClusterNetwork", "MakeLabel", "Row", "ScheduleFit",
           "device_compressor_cost", "device_compute", "module_tensors", "params_compute",
           "params_tensors", "reference_tensors", "simulate"]

#: a label's algorithm, or why it cannot be simulated (a sentence)
MakeLabel = Callable[[str], Priced | str]


def module_tensors(module: nn.Module) -> list[TensorSpec]:
    """Trainable parameters of ``module`` (any device, ``meta`` included) in backward's
    ready order (reverse registration), as fp32 gradients."""
    specs = [TensorSpec(n, tuple(p.shape)) for n, p in module.named_parameters()
             if p.requires_grad]
    if not specs:
        raise ConfigError("the model has no trainable parameters; pass a module with "
                          "requires_grad parameters")
    return specs[::-1]


#: in-place random fills of weight initialisation (``nn.init`` functions, tensor methods)
_RANDOM_FILLS = frozenset({
    "normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
    "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_", "random_", "bernoulli_",
    "exponential_", "geometric_", "log_normal_", "cauchy_"})


class _SkipRandomFills(TorchFunctionMode):
    """Returns the tensor of every random initial fill unchanged. On the meta device a fill
    computes nothing, but torch runs ``normal_`` there through a Python reference that
    imports ``torch._dynamo`` on its first call: about 1.7 CPU-s of ``hexagram simulate``'s
    3-4, for values that do not exist. Shapes, names and dtypes are unaffected."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _RANDOM_FILLS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def reference_tensors(name: str, params: int = 6_300_000, layers: int = 3, width: int = 256,
                      block: int = 64) -> tuple[list[TensorSpec], int]:
    """A registered reference model built on the meta device (nothing allocated): its
    tensors and the tokens per sample (GPT: ``block``, others 1)."""
    from hexagram.models.workload import ModelSpec, build_workload

    spec = ModelSpec(name=name, params=params, layers=layers, width=width, block=block)
    with torch.device("meta"), _SkipRandomFills():
        work = build_workload(spec)
    return module_tensors(work.model), block if name == "gpt" else 1


def params_tensors(params: int, layers: int = 24) -> list[TensorSpec]:
    """``params`` split into ``layers`` equal square matrices (a transformer-like profile)."""
    if params < layers or layers < 1:
        raise ConfigError(f"params ({params}) must be >= layers ({layers}) >= 1")
    h = max(1, round(math.sqrt(params / layers)))
    return [TensorSpec(f"layer{i}.weight", (h, h)) for i in reversed(range(layers))]


def device_compute(tensors: Sequence[TensorSpec], dev: Device, samples: int,
                   tokens: int = 1, efficiency: float = EFFICIENCY) -> ComputeProfile:
    """Compute from a datasheet: ``6 N`` FLOPs per token (2 forward, 4 backward) at
    ``efficiency`` of peak; each gradient ready once backward has passed its share of the
    parameters (FLOPs proportional to parameters: exact for matrix layers); the update
    streams 16 bytes per parameter (Adam) through HBM."""
    n = sum(t.numel for t in tensors)
    flops = 2 * n * samples * tokens / (dev.flops * efficiency)
    backward, ready, done = 2 * flops, [], 0
    for t in tensors:
        done += t.numel
        ready.append(backward * done / n)
    return ComputeProfile(flops, backward, 16 * n / dev.hbm_bps, list(tensors), ready)


def params_compute(params: int, layers: int = 24, dev: str = "h100", samples: int = 32,
                   tokens: int = 1) -> ComputeProfile:
    """:func:`device_compute` of :func:`params_tensors` (``--params N``)."""
    return device_compute(params_tensors(params, layers), device(dev), samples, tokens)


def device_compressor_cost(dev: Device, algorithm: Priced | None = None,
                           passes: float = 4.0) -> CompressorCost:
    """What ``algorithm``'s compressor costs on ``dev``: measured throughput where
    :mod:`hexagram.cost.gpu_measured` has it for this device and compressor (the H100 and
    H200 presets), else a memory-bound compressor (an assumption, stated): encoding reads and
    writes ``passes`` times 4 bytes per element at HBM rate, decoding touches what it
    receives twice, plus 10 us of kernel launches each. For gathered formats the decode
    rate follows the payload's size (``ratio`` of the dense bytes); how many payloads a
    rank decodes (P for an allgather, one per tree round for gTop-k) is the model's
    :func:`hexagram.cost.model.gathered_decodes`."""
    from hexagram.compress.base import Aggregation
    from hexagram.cost.facts import compressor_of
    from hexagram.cost.gpu_measured import measured_cost
    from hexagram.cost.schedule import analytic_payloads, payload_of

    comp = None if algorithm is None else compressor_of(algorithm)
    ratio = 1.0
    if comp is not None and comp.aggregation is Aggregation.GATHER:
        with analytic_payloads():
            ratio = payload_of(comp, (1 << 16,)).nbytes / (4 << 16)
    measured = None if comp is None else measured_cost(dev.name, comp.name, ratio)
    if measured is not None:
        return measured
    per, launch = 4 * passes / dev.hbm_bps, 10e-6
    return CompressorCost((launch, per), (launch, 2 * 4 / dev.hbm_bps * ratio))


@dataclass
class Row:
    """One algorithm at one world size; ``note`` says why a time is absent."""

    label: str
    world: int
    step_s: float | None
    compute_s: float
    exposed_s: float
    compress_s: float
    bytes: int
    speedup: float | None
    note: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def _fits(world: int, schedule: list[list[Message]], free: float) -> bool:
    """An allgather of P payloads must fit in the device memory left after the model."""
    recv = max((m.sent * world // max(world - 1, 1) for b in schedule for m in b
                if m.op == "allgather"), default=0)
    return recv <= free


def simulate(labels: Sequence[str], worlds: Sequence[int], compute: ComputeProfile,
             cluster: Cluster, dev: Device | None = None, bucket_mb: float = 25.0,
             costs: Mapping[str, CompressorCost] | None = None,
             make: MakeLabel | None = None) -> list[Row]:
    """Each algorithm label at each world size, world-major; speed-up is against
    ``allreduce`` at the same size. ``make`` turns a label into its algorithm (or the
    reason it cannot be simulated): by default :func:`hexagram.algorithms.labels.simulable`
    (the registry's names); pass another to price algorithms of your own. ``costs`` maps
    a label to its compressor's cost (e.g.
    :func:`hexagram.cost.profile.measure_compressor` on this machine); labels without one
    get :func:`device_compressor_cost` of ``dev``. ``dev`` may be None: then the cluster's
    ``device`` if it has one, else no memory check and no compression CPU for labels
    without a cost.

    Payload sizes come from shapes and configs (:func:`hexagram.cost.schedule.analytic_payloads`),
    nothing is compressed.

    Raises:
        ConfigError: unknown algorithm or preset, a world size that is not whole hosts.
    """
    dev = cluster.hardware().device if dev is None else dev
    with analytic_payloads():
        return _simulate(labels, worlds, compute, cluster, dev, bucket_mb, costs, make)


def _simulate(labels: Sequence[str], worlds: Sequence[int], compute: ComputeProfile,
              cluster: Cluster, dev: Device | None, bucket_mb: float,
              costs: Mapping[str, CompressorCost] | None, make: MakeLabel | None = None
              ) -> list[Row]:
    if not labels or not worlds:
        raise ConfigError("simulate: give at least one algorithm and one world size")
    if make is None:
        # The one import up from the cost model: users call this public function with the
        # registry's names (its documented use); the pricing itself never reads the registry.
        from hexagram.algorithms.labels import simulable

        make = simulable
    algos = {lb: make(lb) for lb in [*labels, "allreduce"]}
    free = math.inf if dev is None else dev.memory - 16 * sum(t.numel for t in compute.tensors)
    rows = []
    for world in worlds:
        net = cluster.network(world)
        base = predict_any(algos["allreduce"], compute, net,  # type: ignore[arg-type]
                           bucket_bytes=int(bucket_mb * MB))
        for label in labels:
            rows.append(_row(label, algos[label], compute, net, base.step_s, bucket_mb,
                             (costs or {}).get(label), dev, free))
    return rows


def _row(label: str, algorithm: Priced | str, compute: ComputeProfile, net: ClusterNetwork,
         base_s: float, bucket_mb: float, cost: CompressorCost | None, dev: Device | None,
         free: float) -> Row:
    if isinstance(algorithm, str) or not applicable(label, net):
        why = algorithm if isinstance(algorithm, str) else \
            "hierarchical equals flat allreduce with one host"
        return Row(label, net.world, None, compute.step_s, 0.0, 0.0, 0, None,
                   f"skipped: {why}")
    if cost is None and dev is not None:
        cost = device_compressor_cost(dev, algorithm)
    costs = {label: cost} if cost is not None and is_lossy(algorithm) else {}
    p = predict_any(algorithm, compute, net, costs, label=label,
                    bucket_bytes=int(bucket_mb * MB))
    if not _fits(net.world, p.schedule, free):
        return Row(label, net.world, None, p.compute_s, 0.0, 0.0, p.wire_bytes, None,
                   "does not fit: the allgather of P payloads exceeds device memory")
    return Row(label, net.world, p.step_s, p.compute_s, p.exposed_s, p.compress_s,
               p.wire_bytes, base_s / p.step_s, p.note)
