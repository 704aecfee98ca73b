"""Glue for the frameworks users train with (each an optional extra, imported on demand).

- :mod:`hexagram.integrations.lightning`: ``HexagramStrategy`` for ``lightning.Trainer``.
- :mod:`hexagram.integrations.accelerate`: ``prepare()``, Accelerate's recipe with Hexagram.
- :mod:`hexagram.integrations.transformers`: ``HexagramTrainer`` for the Hugging Face Trainer.
- :mod:`hexagram.integrations.gpt2`: a GPT-2 from a config and offline text, shared by the
  examples, tests and benchmarks.

Install the frameworks with ``pip install "hexagram[integrations]"``. This package imports
none of them; each submodule imports only its own framework.

Example:
    >>> from hexagram.integrations import wrapper_and_algorithm_config
    >>> wrapper_and_algorithm_config({"bucket_size_mb": 1, "rank": 2})
    ({'bucket_size_mb': 1}, {'rank': 2})
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["WRAPPER_OPTIONS", "wrap", "wrapper_and_algorithm_config"]

#: keyword arguments of ``hexagram.DistributedDataParallel`` (the rest configure the algorithm).
WRAPPER_OPTIONS = ("bucket_size_mb", "first_bucket_mb", "find_unused_parameters",
                   "broadcast_buffers", "gradient_as_bucket_view")


def wrapper_and_algorithm_config(config: dict[str, Any]) -> tuple[dict[str, Any],
                                                                  dict[str, Any]]:
    """Split ``**config`` into the wrapper's options and the algorithm's config fields."""
    wrapper = {k: v for k, v in config.items() if k in WRAPPER_OPTIONS}
    algorithm = {k: v for k, v in config.items() if k not in WRAPPER_OPTIONS}
    return wrapper, algorithm


def wrap(module: nn.Module, algorithm: Any, config: dict[str, Any],
         optimizers: Any = "later") -> nn.Module:
    """``hexagram.DistributedDataParallel(module, optimizers=..., algorithm=..., **options)``:
    ``config`` mixes wrapper options and algorithm fields (e.g. ``rank=2`` for PowerSGD).
    Frameworks create their optimizers after wrapping: without ``optimizers`` the wrapper
    is told ``optimizers="later"`` and the integration calls ``attach_optimizers``."""
    from hexagram import runtime
    from hexagram.algorithms import registry
    from hexagram.engine.ddp import DistributedDataParallel

    runtime.init()  # idempotent; reuses the framework's process group
    wrapper_kw, algo_kw = wrapper_and_algorithm_config(config)
    algo = registry.get(algorithm, **algo_kw)
    return DistributedDataParallel(module, optimizers=optimizers, algorithm=algo, **wrapper_kw)
