"""Hexagram: distributed PyTorch training when the network is the bottleneck.

Example:
    >>> import hexagram as hx
    >>> hx.init()                                                      # doctest: +SKIP
    >>> model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm="allreduce")
    ... # doctest: +SKIP
"""

from typing import Any

from hexagram import algorithms
from hexagram.engine.ddp import DistributedDataParallel
from hexagram.errors import (
    CommError,
    CommTimeoutError,
    ConfigError,
    HexagramError,
    ModelMismatchError,
    NonFiniteGradientError,
    NotInitializedError,
)
from hexagram.runtime import Runtime, get_runtime, init, is_initialized, shutdown

__version__ = "0.1.0"

__all__ = [
    "CommError",
    "CommTimeoutError",
    "ConfigError",
    "DistributedDataParallel",
    "HexagramError",
    "ModelMismatchError",
    "NonFiniteGradientError",
    "NotInitializedError",
    "Runtime",
    "algorithms",
    "get_runtime",
    "init",
    "is_initialized",
    "shutdown",
]

__all__ += ["load_checkpoint", "save_checkpoint"]


def __getattr__(name: str) -> Any:
    # The checkpoint helpers import torch.distributed.checkpoint (DTensor and its op tables):
    # about a quarter of `import hexagram`, paid by every rank process otherwise.
    if name in ("load_checkpoint", "save_checkpoint"):
        from hexagram.elastic import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'hexagram' has no attribute {name!r}")
