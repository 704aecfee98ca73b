"""Hexagram: distributed PyTorch training when the network is the bottleneck.

Example:
    >>> import hexagram as hx
    >>> hx.init()                                                      # doctest: +SKIP
    >>> model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm="allreduce")
    ... # doctest: +SKIP
"""

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

from hexagram.elastic.checkpoint import load_checkpoint, save_checkpoint

__all__ += ["load_checkpoint", "save_checkpoint"]
