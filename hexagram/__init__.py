"""Hexagram: distributed PyTorch training when the network is the bottleneck.

Example:
    >>> import hexagram as hx
    >>> hx.init()                                                      # doctest: +SKIP
    >>> model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm="allreduce")
    ... # doctest: +SKIP
"""

import importlib
from typing import TYPE_CHECKING, Any

from hexagram.errors import (
    CommError,
    CommTimeoutError,
    ConfigError,
    HexagramError,
    ModelMismatchError,
    NonFiniteGradientError,
    NotInitializedError,
)

if TYPE_CHECKING:
    from hexagram import algorithms
    from hexagram.engine.ddp import DistributedDataParallel
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

#: public name -> the module that defines it, imported on first use. `import hexagram` itself
#: imports neither torch nor any of these: torch costs ~2 CPU-s, the engine a little more
#: (it marks its eager frames without importing torch._dynamo: hexagram.engine.eager) and
#: the checkpoint helpers torch.distributed.checkpoint; `hexagram --help`,
#: `hexagram simulate --help` and the planning commands need none of them.
_LAZY = {
    "DistributedDataParallel": "hexagram.engine.ddp",
    "Runtime": "hexagram.runtime",
    "get_runtime": "hexagram.runtime",
    "init": "hexagram.runtime",
    "is_initialized": "hexagram.runtime",
    "shutdown": "hexagram.runtime",
    "load_checkpoint": "hexagram.elastic.checkpoint",
    "save_checkpoint": "hexagram.elastic.checkpoint",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if not name.startswith("_"):  # a subpackage not imported yet: hx.algorithms, hx.elastic
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'hexagram' has no attribute {name!r}")
