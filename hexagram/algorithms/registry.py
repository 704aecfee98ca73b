"""The explicit registry of algorithms: ``get(name, **config)`` and ``names()``.

Each entry names the module, its frozen config dataclass and its algorithm class; modules
are imported on first use so a broken optional algorithm cannot break ``import hexagram``.
Add an algorithm by adding one line to ``_ENTRIES``.

Example:
    >>> from hexagram.algorithms import registry
    >>> "allreduce" in registry.names()
    True
    >>> registry.get("allreduce", hierarchical=True).config.hierarchical
    True
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from hexagram.algorithms.base import Algorithm
from hexagram.config import build_config

__all__ = ["Entry", "entries", "get", "names"]


@dataclass(frozen=True)
class Entry:
    """Where an algorithm lives and a one-line summary for tables and ``--help``."""

    name: str
    module: str
    config: str
    algorithm: str
    summary: str

    def load(self) -> tuple[type, type[Algorithm]]:
        mod = importlib.import_module(self.module)
        return getattr(mod, self.config), getattr(mod, self.algorithm)


_ENTRIES: tuple[Entry, ...] = (
    Entry("allreduce", "hexagram.algorithms.allreduce", "AllreduceConfig", "AllreduceAlgorithm",
          "full-precision gradient allreduce (optionally hierarchical), like PyTorch DDP"),
    Entry("fp16", "hexagram.algorithms.fp16", "Fp16Config", "Fp16Algorithm",
          "16-bit (fp16 or bf16) gradient allreduce: half the bytes of allreduce"),
    Entry("powersgd", "hexagram.algorithms.powersgd", "PowerSGDConfig", "PowerSGDAlgorithm",
          "rank-r PowerSGD: power iteration, warm start, error feedback (Vogels et al. 2019)"),
    Entry("bytegrad", "hexagram.algorithms.bytegrad", "ByteGradConfig", "ByteGradAlgorithm",
          "8-bit min-max gradients by scatter-gather (BAGUA's ByteGrad)"),
    Entry("qsgd", "hexagram.algorithms.qsgd", "QSGDConfig", "QSGDAlgorithm",
          "QSGD stochastic quantization, unbiased (Alistarh et al. 2017)"),
    Entry("terngrad", "hexagram.algorithms.terngrad", "TernGradConfig", "TernGradAlgorithm",
          "ternary gradients {-s, 0, s}, unbiased, layer-wise scale (Wen et al. 2017)"),
    Entry("onebit", "hexagram.algorithms.onebit", "OneBitConfig", "OneBitAlgorithm",
          "1-bit SGD with error feedback (Seide et al. 2014)"),
    Entry("efsign", "hexagram.algorithms.efsign", "EFSignConfig", "EFSignAlgorithm",
          "scaled signs with error feedback, EF-signSGD (Karimireddy et al. 2019)"),
    Entry("signsgd", "hexagram.algorithms.signsgd", "SignSGDConfig", "SignSGDAlgorithm",
          "signs by allgather, element-wise majority vote (Bernstein et al. 2018)"),
    Entry("topk", "hexagram.algorithms.topk", "TopKConfig", "TopKAlgorithm",
          "top-k (index, value) pairs by allgather, error feedback"),
    Entry("gtopk", "hexagram.algorithms.gtopk", "GTopKConfig", "GTopKAlgorithm",
          "global top-k by gTopKAllReduce on a tree, error feedback (Shi et al. 2019)"),
    Entry("dgc", "hexagram.algorithms.dgc", "DGCConfig", "DGCAlgorithm",
          "Deep Gradient Compression: top-k, momentum correction, clipping, warm-up"),
    Entry("randomk", "hexagram.algorithms.randomk", "RandomKConfig", "RandomKAlgorithm",
          "random-k with positions shared by all ranks, error feedback"),
    Entry("decentralized", "hexagram.algorithms.decentralized", "DecentralizedConfig",
          "DecentralizedAlgorithm", "full-precision weight exchange with peers (all, ring, "
          "shift_one, random) every `interval` steps, overlapped with the forward pass"),
    Entry("low_precision_decentralized", "hexagram.algorithms.low_precision_decentralized",
          "LowPrecisionDecentralizedConfig", "LowPrecisionDecentralizedAlgorithm",
          "compressed (8-bit by default) weight differences with ring neighbours (CHOCO)"),
    Entry("local_sgd", "hexagram.algorithms.local_sgd", "LocalSGDConfig", "LocalSGDAlgorithm",
          "average weights every H steps, optional warm-up and compression (post-local SGD)"),
    Entry("diloco", "hexagram.algorithms.diloco", "DiLoCoConfig", "DiLoCoAlgorithm",
          "inner optimizer for H steps, outer Nesterov on averaged pseudo-gradients; streaming"),
    Entry("async", "hexagram.algorithms.async_model_average", "AsyncConfig",
          "AsyncModelAverageAlgorithm", "background thread averages weights every N ms"),
    Entry("qadam", "hexagram.algorithms.qadam", "QAdamConfig", "QAdamAlgorithm",
          "Adam warm-up, then compressed momentum with frozen variance and error feedback"),
    Entry("robust", "hexagram.algorithms.robust", "RobustConfig", "RobustAlgorithm",
          "Byzantine-robust: trimmed mean, median, (multi-)Krum, geomed, centered clip"),
)


def entries() -> dict[str, Entry]:
    """All registered algorithms by name, in registration order."""
    return {e.name: e for e in _ENTRIES}


def names() -> list[str]:
    """Registered algorithm names."""
    return [e.name for e in _ENTRIES]


def get(name: str | Algorithm, **config: Any) -> Algorithm:
    """A new algorithm instance: ``get("allreduce", hierarchical=True)``.

    Raises:
        ValueError: unknown name (lists the valid names).
        ConfigError: unknown config field or a value out of range (names the field).
    """
    if isinstance(name, Algorithm):
        if config:
            raise ValueError("pass config either to hexagram.algorithms.get(name, **config) or "
                             "to the algorithm's constructor, not both")
        return name
    table = entries()
    if name not in table:
        raise ValueError(f"unknown algorithm {name!r}; valid names: {', '.join(table)}")
    config_cls, algorithm_cls = table[name].load()
    return algorithm_cls(build_config(config_cls, config))
