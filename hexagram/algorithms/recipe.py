"""Declarative compressed-gradient algorithms: a registry line names the compressor.

A :class:`Recipe` says which compressor an algorithm applies, which options it has (their
defaults, checks, and which compressor argument each one sets), whether error feedback is
on by default, the default granularity, and how the ranks' decoded segments combine. The
algorithm is then :class:`RecipeAlgorithm`: compress each segment (with error feedback if
on) and exchange it through :func:`hexagram.comm.reduce.reduce_many`, whose collective
follows the compressor's aggregation. No file per algorithm, no config class per algorithm
written by hand: :func:`classes` builds both from the recipe, and every validation error
names the algorithm (``algorithm 'qsgd': levels must be ...``), never a class that shares
its name with a compressor's config.

Every recipe has the :class:`~hexagram.algorithms.compressed.CompressedConfig` fields
(``granularity``, ``on_nonfinite``, ``seed``) and an ``error_feedback`` switch.

Example:
    >>> from hexagram.algorithms.registry import entries
    >>> config_cls, algo_cls = entries()["qsgd"].load()
    >>> config_cls(levels=3).levels, algo_cls.name
    (3, 'qsgd')
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from hexagram import compress
from hexagram.algorithms.base import AlgorithmContext
from hexagram.algorithms.compressed import CompressedConfig, CompressorAlgorithm
from hexagram.config import check_choice

__all__ = ["LrNote", "Option", "Recipe", "RecipeAlgorithm", "classes"]


@dataclass(frozen=True)
class LrNote:
    """The learning-rate change a configuration needs to train like allreduce with the
    user's optimizer: machine-readable (``auto`` reads ``factor``), warned at wrap time.

    Attributes:
        factor: multiply the optimizer's lr by this (about); 1.0 would be a drop-in.
        why: what makes it necessary and how to avoid it (a drop-in configuration).

    Example:
        >>> LrNote(0.1, "momentum stacks").message("dgc")
        "algorithm 'dgc' needs the learning rate multiplied by about 0.1: momentum stacks"
    """

    factor: float
    why: str

    def message(self, name: str) -> str:
        """The wrap-time warning, naming the algorithm and the factor."""
        return f"algorithm {name!r} needs the learning rate multiplied by about " \
               f"{self.factor:g}: {self.why}"


@dataclass(frozen=True)
class Option:
    """One option of a recipe.

    Attributes:
        default: its value when not given.
        doc: what it does and which way it pushes (shown in the config's docstring).
        check: ``check(config, name)`` raising :class:`~hexagram.errors.ConfigError`
            (e.g. ``functools.partial(check_int, low=1)``); ``None``: no check.
        to_compressor: the compressor argument it sets (``""``: the same name; ``None``:
            not passed to the compressor).
    """

    default: Any
    doc: str
    check: Callable[[Any, str], None] | None = None
    to_compressor: str | None = ""


@dataclass(frozen=True, eq=False)  # compared (and cached) by identity
class Recipe:
    """A compressed-gradient algorithm as data (see the module doc).

    Attributes:
        name: the algorithm's registry name.
        compressor: the compressor's registry name (``hexagram.compress.names()``).
        summary: one line for tables and ``--help``.
        options: the algorithm's own options, in order.
        error_feedback: default of the ``error_feedback`` switch.
        granularity: default granularity (``"layer"`` or ``"bucket"``).
        reduction: ``"mean"``, or ``"majority"`` (the sign of the sum: signSGD's vote).
        seeded: pass the config's ``seed`` to the compressor (stochastic compressors).
        lr_warning: ``lr_warning(config)``: the :class:`LrNote` (learning-rate factor and
            why) a configuration needs (warned once at wrap time,
            :meth:`RecipeAlgorithm.setup`; read by ``auto`` through
            :meth:`RecipeAlgorithm.lr_note`), or ``None`` when it is a drop-in.
    """

    name: str
    compressor: str
    summary: str
    options: dict[str, Option] = field(default_factory=dict)
    error_feedback: bool = False
    granularity: str = "layer"
    reduction: str = "mean"
    seeded: bool = False
    lr_warning: Callable[[Any], LrNote | None] | None = None


class RecipeAlgorithm(CompressorAlgorithm):
    """The algorithm of a :class:`Recipe` (bound by :func:`classes`)."""

    recipe: Recipe

    def __init__(self, config: Any = None) -> None:
        super().__init__(config if config is not None else classes(self.recipe)[0]())
        r, c = self.recipe, cast(Any, self.config)  # a generated dataclass (see classes)
        args = {o.to_compressor or n: getattr(c, n) for n, o in r.options.items()
                if o.to_compressor is not None}
        if r.seeded:
            args["seed"] = c.seed
        self.use_compressor(compress.get(r.compressor, **args),
                            feedback=bool(c.error_feedback))

    def lr_note(self, optimizers: Sequence[torch.optim.Optimizer] = ()) -> LrNote | None:
        """The lr change this configuration needs (None: a drop-in); see :class:`LrNote`."""
        return self.recipe.lr_warning(self.config) if self.recipe.lr_warning else None

    def setup(self, ctx: AlgorithmContext) -> None:
        """Set up (see the base class), warning if this configuration needs another lr."""
        super().setup(ctx)
        note = self.lr_note(ctx.optimizers)
        if note:
            warnings.warn(note.message(self.recipe.name), UserWarning, stacklevel=2)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


@functools.cache
def classes(recipe: Recipe) -> tuple[type, type[RecipeAlgorithm]]:
    """(config class, algorithm class) of ``recipe``, built once."""
    specs: list[tuple[str, Any, Any]] = [
        (n, Any, dataclasses.field(default=o.default)) for n, o in recipe.options.items()]
    specs += [("error_feedback", bool, dataclasses.field(default=recipe.error_feedback)),
              ("granularity", str, dataclasses.field(default=recipe.granularity))]

    def post_init(self: Any) -> None:
        CompressedConfig.__post_init__(self)
        check_choice(self, "error_feedback", (True, False))
        for n, o in recipe.options.items():
            if o.check is not None:
                o.check(self, n)

    doc = "\n".join([f"Config of the {recipe.name!r} algorithm: {recipe.summary}.", "",
                     "Attributes:"]
                    + [f"    {n}: {o.doc}" for n, o in recipe.options.items()]
                    + ["    error_feedback: carry the compression error to the next step "
                       f"(default {recipe.error_feedback})",
                       "    granularity, on_nonfinite, seed: see CompressedConfig."])
    config_cls = dataclasses.make_dataclass(
        f"{_camel(recipe.name)}AlgorithmConfig", specs, bases=(CompressedConfig,),
        frozen=True, kw_only=True,
        namespace={"__post_init__": post_init, "__doc__": doc, "algorithm": recipe.name,
                   "__module__": __name__})
    algo_cls = type(f"{_camel(recipe.name)}Algorithm", (RecipeAlgorithm,),
                    {"name": recipe.name, "recipe": recipe, "reduction": recipe.reduction,
                     "__doc__": f"The {recipe.name!r} algorithm: {recipe.summary}.",
                     "__module__": __name__})
    return config_cls, algo_cls
