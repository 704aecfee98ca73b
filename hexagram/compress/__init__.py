"""Compressors: tensor -> Payload (the bytes on the wire) -> tensor.

``hexagram.compress.get(name, **config)`` returns a compressor; ``names()`` lists them.
:class:`ErrorFeedback` wraps any compressor with keyed residuals.

Modules: ``quantize_fp`` (fp16, bf16), ``quantize`` (minmax8, qsgd, terngrad), ``signs``
(sign, efsign, onebit), ``sparsify`` (topk, randomk, threshold), ``lowrank`` (powersgd and
its two-phase step API), ``feedback`` (error feedback), ``packing`` (bit packing, block
sizes per device), ``codes`` (truncation, stochastic rounding). Each
module's docstring gives its wire format (``Payload.nbytes`` as a formula).

Example:
    >>> import torch, hexagram.compress as hc
    >>> c = hc.get("fp16")
    >>> c.decompress(c.compress(torch.ones(3)))
    tensor([1., 1., 1.])
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from hexagram.compress.base import Aggregation, Compressor, Payload, check_compressible
from hexagram.compress.feedback import ErrorFeedback
from hexagram.config import build_config, unknown_name

__all__ = [
    "Aggregation",
    "Compressor",
    "ErrorFeedback",
    "Payload",
    "check_compressible",
    "get",
    "names",
    "summaries",
]


@dataclass(frozen=True)
class _Entry:
    module: str
    config: str
    compressor: str
    summary: str


# The explicit registry: one line per compressor (module, config class, compressor class).
_ENTRIES: dict[str, _Entry] = {
    "fp16": _Entry("hexagram.compress.quantize_fp", "CastConfig", "HalfCompressor",
                   "IEEE half precision, 16 bits/element, summable"),
    "bf16": _Entry("hexagram.compress.quantize_fp", "CastConfig", "BF16Compressor",
                   "bfloat16, 16 bits/element, summable"),
    "minmax8": _Entry("hexagram.compress.quantize", "MinMax8Config", "MinMax8Compressor",
                      "8-bit min-max per chunk (BAGUA ByteGrad), scatter-gather"),
    "minmax4": _Entry("hexagram.compress.quantize", "MinMax4Config", "MinMax4Compressor",
                      "4-bit min-max per chunk (deterministic), scatter-gather"),
    "qsgd": _Entry("hexagram.compress.quantize", "QSGDConfig", "QSGDCompressor",
                   "QSGD: s levels, stochastic, unbiased, ceil(log2(2s+1)) bits/element"),
    "terngrad": _Entry("hexagram.compress.ternary", "TernGradConfig", "TernGradCompressor",
                       "TernGrad: max-scaled ternary, stochastic, unbiased, 2 bits/element"),
    "onebit": _Entry("hexagram.compress.signs", "SignConfig", "OneBitCompressor",
                     "1-bit SGD: sign bit + mean of each half, use with error feedback"),
    "sign": _Entry("hexagram.compress.signs", "SignVoteConfig", "SignCompressor",
                   "signSGD: 1 bit/element, decodes to +-1 (majority vote)"),
    "efsign": _Entry("hexagram.compress.signs", "SignConfig", "EFSignCompressor",
                     "scaled sign (||x||_1/n) * sign(x), use with error feedback"),
    "topk": _Entry("hexagram.compress.sparsify", "TopKConfig", "TopKCompressor",
                   "k largest magnitudes (exact, or approximate threshold from a sample)"),
    "randomk": _Entry("hexagram.compress.sparsify", "RandomKConfig", "RandomKCompressor",
                      "k random entries (stratified), rescaled to be unbiased"),
    "threshold": _Entry("hexagram.compress.threshold", "ThresholdConfig", "ThresholdCompressor",
                        "entries with |x| >= threshold, fixed capacity + count header"),
    "powersgd": _Entry("hexagram.compress.lowrank", "PowerSGDConfig", "PowerSGDCompressor",
                       "PowerSGD rank-r factors, warm start; two allreduces (step API)"),
}


def names() -> list[str]:
    """Registered compressor names."""
    return list(_ENTRIES)


def summaries() -> dict[str, str]:
    """One-line description of each compressor."""
    return {n: e.summary for n, e in _ENTRIES.items()}


def get(name: str, **config: Any) -> Compressor:
    """A new compressor: ``get("qsgd", levels=16, seed=0)``.

    Raises:
        ConfigError: unknown name (lists the valid names and the closest), unknown field
            or out-of-range value (names the field).
    """
    if name not in _ENTRIES:
        raise unknown_name("compressor", name, _ENTRIES)
    e = _ENTRIES[name]
    mod = importlib.import_module(e.module)
    cfg = build_config(getattr(mod, e.config), config)
    compressor: Compressor = getattr(mod, e.compressor)(cfg)
    return compressor
