"""The explicit registry of algorithms: ``get(name, **config)`` and ``names()``.

Each entry names the module, its frozen config dataclass and its algorithm class; modules
are imported on first use so a broken optional algorithm cannot break ``import hexagram``.
Add an algorithm by adding one line to ``_ENTRIES``. A compressed-gradient algorithm that
only applies a compressor is a :class:`~hexagram.algorithms.recipe.Recipe` instead (the
compressor, its options and defaults, feedback, granularity): ``Entry.declared(Recipe(...))``.
An entry also says whether ``algorithm="auto"`` considers the algorithm by default and at
which configs (``auto=Candidacy(...)``) and whether the planner prices it for a stage's
data-parallel sync and at which config (``planner=Planned(...)``); what the cost model reads
off the algorithm itself is in :mod:`hexagram.cost.facts`.

Wrappers compose with any gradient algorithm through ``get``: ``get("powersgd",
hierarchical=True)`` reduces inside each host first and runs PowerSGD between host leaders
(:mod:`hexagram.algorithms.wrappers`); ``get("topk", delay=1)`` applies each step the
gradient reduced during the previous one (:mod:`hexagram.algorithms.delay`).

Example:
    >>> from hexagram.algorithms import registry
    >>> "allreduce" in registry.names()
    True
    >>> registry.get("allreduce", hierarchical=True).config.hierarchical
    True
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from hexagram.algorithms.base import Algorithm
from hexagram.algorithms.recipe import LrNote, Option, Recipe, classes
from hexagram.algorithms.wrappers import WRAPPER_OPTIONS, wrap
from hexagram.config import build_config, check_choice, check_float, check_int, unknown_name

__all__ = ["Candidacy", "Entry", "Planned", "auto_candidates", "entries", "get", "names",
           "planner_options", "planner_priced"]


@dataclass(frozen=True)
class Candidacy:
    """``algorithm="auto"``'s default candidates among one algorithm's configs: ``labels``
    (``NAME[:FIELD=VALUE...]``, :mod:`hexagram.cost.labels`); ``delayed`` ones (weight
    algorithms: they delay or decentralize the update) only with ``allow_delay=True``."""

    labels: tuple[str, ...]
    delayed: bool = False


@dataclass(frozen=True)
class Planned:
    """The planner prices the algorithm for a stage's data-parallel sync
    (:func:`hexagram.parallel.relax_cost.sync_cost`) at ``options``, the config it also
    emits (``StagePlan.dp_options``; ``{}``: the registry defaults)."""

    options: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Entry:
    """Where an algorithm lives, a one-line summary for tables and ``--help``, whether
    ``auto`` considers it by default (``auto``) and whether the planner prices it
    (``planner``: :func:`hexagram.parallel.relax_cost.sync_cost`)."""

    name: str
    module: str
    config: str
    algorithm: str
    summary: str
    recipe: Recipe | None = None
    auto: Candidacy | None = None
    planner: Planned | None = None

    @classmethod
    def declared(cls, recipe: Recipe, auto: Candidacy | None = None,
                 planner: Planned | None = None) -> Entry:
        """The entry of a declarative compressed-gradient algorithm."""
        return cls(recipe.name, "hexagram.algorithms.recipe", "", "", recipe.summary, recipe,
                   auto, planner)

    def load(self) -> tuple[type, type[Algorithm]]:
        """(config class, algorithm class)."""
        if self.recipe is not None:
            return classes(self.recipe)
        mod = importlib.import_module(self.module)
        return getattr(mod, self.config), getattr(mod, self.algorithm)

    @property
    def kind(self) -> str:
        """``"grad"`` or ``"weight"``: what the algorithm communicates (loads it)."""
        return str(self.load()[1].kind)


_DENSITY = partial(check_float, low=0.0, high=1.0, low_open=True)
#: efsign's and onebit's scale block (hexagram.compress.sign_blocks). Fashion-MNIST, 4 ranks,
#: the user's SGD lr 0.05, momentum 0.9, 5 epochs (allreduce 85.5 %): per tensor, 1-bit
#: SGD 47.3 % and EF-sign 49.6 %; blocks of 512: 83.1 / 81.3 %; of 256: 85.0 / 83.5 %
_SIGN_BLOCK = Option(256, "elements sharing one scale (efsign) or pair of values (onebit); "
                     "smaller => less error-feedback staleness, more header bytes (4 resp. 8 "
                     "per block); 0 => one per tensor (the papers' format, not a drop-in on "
                     "Fashion-MNIST)", partial(check_int, low=0, high=1 << 24))
_APPROXIMATE = Option(True, "estimate the top-k threshold from a sample (DGC's trick): "
                      "faster on large tensors, same selection (exact top-k when it misses)")


def _pure_vote_lr(config: Any) -> LrNote | None:
    """signsgd's pure vote (scaled=False) moves each element by the whole learning rate."""
    if config.scaled:
        return None
    return LrNote(0.015, "scaled=False: the pure majority vote moves every element by the "
                  "whole learning rate (digits MLP: lr 0.0015 matched allreduce at 0.1); or "
                  "keep scaled=True (the default), a drop-in for the user's lr")


#: auto's PowerSGD compresses from its first step: its default 10 allreduce warm-up steps
#: would run at allreduce's speed after the decision, where auto's own timing trials
#: already stand in for a warm-up
_POWERSGD_AUTO = Candidacy(("powersgd:start_iter=0",))
#: the planner's PowerSGD trains like allreduce as a drop-in, not the registry default: rank
#: 2 is the paper's speed setting; rank 8 is the lowest that ends within 1 % of allreduce's
#: loss on a small GPT with AdamW (docs/benchmarks/planner.md, section 6). ``start_iter`` 10
#: keeps the paper's
#: full-precision warm-up (auto drops it: there the first steps are timing trials, here a
#: plan trains from step 0)
_POWERSGD_PLANNED = Planned({"rank": 8, "start_iter": 10})

_ENTRIES: tuple[Entry, ...] = (
    Entry("allreduce", "hexagram.algorithms.allreduce", "AllreduceConfig", "AllreduceAlgorithm",
          "full-precision gradient allreduce (optionally hierarchical), like PyTorch DDP",
          auto=Candidacy(("allreduce", "allreduce:hierarchical=true")), planner=Planned()),
    Entry("fp16", "hexagram.algorithms.fp16", "Fp16Config", "Fp16Algorithm",
          "16-bit (fp16 or bf16) gradient allreduce: half the bytes of allreduce",
          auto=Candidacy(("fp16", "fp16:wire=bf16")), planner=Planned()),
    Entry("powersgd", "hexagram.algorithms.powersgd", "PowerSGDAlgorithmConfig",
          "PowerSGDAlgorithm",
          "rank-r PowerSGD: power iteration, warm start, error feedback (Vogels et al. 2019)",
          auto=_POWERSGD_AUTO, planner=_POWERSGD_PLANNED),
    Entry.declared(Recipe(
        "bytegrad", "minmax8", "8-bit min-max gradients by scatter-gather (BAGUA's ByteGrad)",
        {"chunk_size": Option(1024, "elements sharing one (min, step) pair; smaller => finer "
                              "scales, more header bytes (8 per chunk)",
                              partial(check_int, low=1, high=1 << 24))},
        granularity="bucket"), auto=Candidacy(("bytegrad",))),
    Entry.declared(Recipe(
        "qsgd", "qsgd", "QSGD stochastic quantization, unbiased (Alistarh et al. 2017)",
        {"levels": Option(7, "s, levels per sign; more => lower variance, more bits per "
                          "element (ceil(log2(2s + 1)))", partial(check_int, low=1, high=127)),
         "bucket_size": Option(512, "elements sharing one norm; smaller => lower variance, "
                               "more header bytes", partial(check_int, low=1, high=1 << 24))},
        seeded=True), auto=Candidacy(("qsgd",))),
    Entry.declared(Recipe(
        "terngrad", "terngrad",
        "ternary gradients {-s, 0, s}, unbiased, layer-wise scale (Wen et al. 2017)",
        {"clip": Option(2.5, "clip |g| to clip * std(g) before ternarizing (the paper's 2.5): "
                        "smaller scale and variance, a little bias; 0 => no clipping",
                        partial(check_float, low=0.0))},
        seeded=True), auto=Candidacy(("terngrad",))),
    Entry.declared(Recipe("onebit", "onebit", "1-bit SGD with error feedback (Seide et al. 2014)",
                          {"block": _SIGN_BLOCK}, error_feedback=True),
                   auto=Candidacy(("onebit",))),
    Entry.declared(Recipe(
        "efsign", "efsign", "scaled signs with error feedback, EF-signSGD (Karimireddy et al. "
        "2019)", {"block": _SIGN_BLOCK}, error_feedback=True),
        auto=Candidacy(("efsign",))),
    Entry.declared(Recipe(
        "signsgd", "sign", "signs by allgather, element-wise majority vote scaled by the "
        "ranks' mean rms(g) (Bernstein et al. 2018)",
        {"scaled": Option(True, "multiply the vote by the ranks' mean of rms(g) = ||g||_2 / "
                          "sqrt(n) per segment (one float each sends): a drop-in for the "
                          "user's learning rate; False => the pure vote, each element "
                          "moves by the full learning rate",
                          partial(check_choice, choices=(True, False)))},
        granularity="bucket", reduction="majority", lr_warning=_pure_vote_lr)),
    Entry.declared(Recipe(
        "topk", "topk", "top-k (index, value) pairs by allgather, error feedback",
        {"density": Option(0.02, "fraction of elements sent per segment; lower => fewer "
                           "bytes, slower convergence (0.02: a drop-in at SGD lr 0.05, "
                           "momentum 0.9 on digits, where 0.01 ended 2.0 points below "
                           "allreduce)", _DENSITY),
         "approximate": _APPROXIMATE},
        error_feedback=True), auto=Candidacy(("topk",)), planner=Planned()),
    Entry("gtopk", "hexagram.algorithms.gtopk", "GTopKConfig", "GTopKAlgorithm",
          "global top-k by gTopKAllReduce on a tree, error feedback (Shi et al. 2019)",
          auto=Candidacy(("gtopk",))),
    Entry("dgc", "hexagram.algorithms.dgc", "DGCConfig", "DGCAlgorithm",
          "Deep Gradient Compression: top-k, momentum correction, clipping, warm-up",
          auto=Candidacy(("dgc",))),
    Entry("decoupled_momentum", "hexagram.algorithms.decoupled_momentum", "DeMoConfig",
          "DeMoAlgorithm", "DeMo: local momenta, top-k of their chunked DCT by allgather, "
          "sign update scaled by its RMS; takes SGD momentum over",
          auto=Candidacy(("decoupled_momentum",))),
    Entry("randomk", "hexagram.algorithms.randomk", "RandomKAlgorithmConfig", "RandomKAlgorithm",
          "random-k with positions shared by all ranks, error feedback"),
    Entry("decentralized", "hexagram.algorithms.decentralized", "DecentralizedConfig",
          "DecentralizedAlgorithm", "full-precision weight exchange with peers (all, ring, "
          "shift_one, random) every `interval` steps, overlapped with the forward pass",
          auto=Candidacy(("decentralized",), delayed=True)),
    Entry("low_precision_decentralized", "hexagram.algorithms.low_precision_decentralized",
          "LowPrecisionDecentralizedConfig", "LowPrecisionDecentralizedAlgorithm",
          "compressed (8-bit by default) weight differences with ring neighbours (CHOCO)",
          auto=Candidacy(("low_precision_decentralized",), delayed=True)),
    Entry("local_sgd", "hexagram.algorithms.local_sgd", "LocalSGDConfig", "LocalSGDAlgorithm",
          "average weights every H steps, optional warm-up and compression (post-local SGD)",
          auto=Candidacy(("local_sgd",), delayed=True)),
    Entry("diloco", "hexagram.algorithms.diloco", "DiLoCoConfig", "DiLoCoAlgorithm",
          "inner optimizer for H steps, outer Nesterov on averaged pseudo-gradients; streaming",
          auto=Candidacy(("diloco",), delayed=True)),
    Entry("sparseloco", "hexagram.algorithms.sparseloco", "SparseLoCoConfig",
          "SparseLoCoAlgorithm", "DiLoCo with chunked top-k, 2-bit pseudo-gradients and error "
          "feedback in place of outer momentum; streaming",
          auto=Candidacy(("sparseloco",), delayed=True)),
    Entry("async", "hexagram.algorithms.async_model_average", "AsyncConfig",
          "AsyncModelAverageAlgorithm", "background thread averages weights every N ms",
          auto=Candidacy(("async",), delayed=True)),
    Entry("qadam", "hexagram.algorithms.qadam", "QAdamConfig", "QAdamAlgorithm",
          "Adam warm-up, then compressed momentum with frozen variance and error feedback"),
    Entry("auto", "hexagram.auto.algorithm", "AutoConfig", "AutoAlgorithm",
          "measures compute, compressors and network, predicts every candidate, runs the best"),
    Entry("robust", "hexagram.algorithms.robust", "RobustConfig", "RobustAlgorithm",
          "Byzantine-robust: trimmed mean, median, (multi-)Krum, geomed, centered clip"),
)


def entries() -> dict[str, Entry]:
    """All registered algorithms by name, in registration order."""
    return {e.name: e for e in _ENTRIES}


def names() -> list[str]:
    """Registered algorithm names."""
    return [e.name for e in _ENTRIES]


def auto_candidates(delayed: bool = False) -> tuple[str, ...]:
    """The labels ``algorithm="auto"`` considers by default, in registration order: the
    synchronous ones, or (``delayed``) those that delay or decentralize the update.

    >>> auto_candidates()[:2], auto_candidates(delayed=True)[0]
    (('allreduce', 'allreduce:hierarchical=true'), 'decentralized')
    """
    return tuple(label for e in _ENTRIES if e.auto is not None and e.auto.delayed == delayed
                 for label in e.auto.labels)


def planner_priced() -> tuple[str, ...]:
    """Names of the algorithms the planner prices for a stage's data-parallel sync."""
    return tuple(e.name for e in _ENTRIES if e.planner is not None)


def planner_options() -> dict[str, dict[str, Any]]:
    """The config the planner prices and emits, per algorithm it prices (copies).

    >>> planner_options()["powersgd"], planner_options()["fp16"]
    ({'rank': 8, 'start_iter': 10}, {})
    """
    return {e.name: dict(e.planner.options) for e in _ENTRIES if e.planner is not None}


def get(name: str | Algorithm, **config: Any) -> Algorithm:
    """A new algorithm instance: ``get("allreduce", hierarchical=True)``.

    ``config`` holds the algorithm's config fields, plus the wrapper options
    (:data:`~hexagram.algorithms.wrappers.WRAPPER_OPTIONS`, e.g. ``hierarchical=True``,
    ``delay=1``) for any gradient algorithm that has no field of that name: ``get("powersgd",
    hierarchical=True, delay=1, rank=4)``.

    Raises:
        ConfigError: unknown name (lists the valid names and the closest), unknown config
            field or a value out of range (names the field).
    """
    options = {k: config.pop(k) for k in WRAPPER_OPTIONS if k in config}
    if isinstance(name, Algorithm):
        if config:
            raise ValueError("pass config either to hexagram.algorithms.get(name, **config) or "
                             "to the algorithm's constructor, not both")
        return wrap(name, **options)
    table = entries()
    if name not in table:
        raise unknown_name("algorithm", name, table)
    config_cls, algorithm_cls = table[name].load()
    own = {f.name for f in dataclasses.fields(config_cls)}
    config.update({k: v for k, v in options.items() if k in own})  # e.g. allreduce's
    algorithm = algorithm_cls(build_config(config_cls, config, owner=f"algorithm {name!r}"))
    return wrap(algorithm, **{k: v for k, v in options.items() if k not in own})
