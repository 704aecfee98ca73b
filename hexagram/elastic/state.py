"""One rank's training state as flat tensors for ``torch.distributed.checkpoint``.

A rank's state is ``{"model", "optimizers", "algorithm", "rng", "extra", "step"}``: nested
dicts/lists holding tensors and small Python values. :func:`flatten` turns it into
``{"r<rank>/<path>": tensor}`` plus a pickled *structure* (the nesting, with each tensor
replaced by its key) stored as a uint8 tensor under ``"r<rank>/__structure__"``: DCP then
only ever sees flat tensors, and :func:`unflatten` rebuilds the exact original.

Example:
    >>> flat = flatten({"a": [torch.ones(2), 3]}, rank=1)
    >>> sorted(flat)
    ['r1/__structure__', 'r1/a/0']
    >>> unflatten(flat, rank=1)["a"][1]
    3
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hexagram.errors import ConfigError, HexagramError

__all__ = ["CheckpointError", "apply_rank_state", "collect_rank_state", "fingerprint",
           "flatten", "replica_device", "residual_tensors", "unflatten", "without_residuals"]

_TENSOR = "__hexagram_tensor__"
#: (parent key, key) of the error-feedback residuals in an algorithm state
_RESIDUALS = ("feedback", "residuals")


class CheckpointError(HexagramError):
    """A checkpoint cannot be saved or loaded here (the message names the mismatch and fix)."""


def flatten(state: Any, rank: int) -> dict[str, torch.Tensor]:
    """``{"r<rank>/<path>": tensor}`` plus the pickled structure (see the module doc)."""
    flat: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            key = f"r{rank}/{path}"
            flat[key] = obj.detach().contiguous()
            return {_TENSOR: key}
        if isinstance(obj, dict):
            return {k: walk(v, f"{path}/{k}" if path else str(k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return obj

    structure = walk(state, "")
    blob = bytearray(pickle.dumps(structure, protocol=pickle.HIGHEST_PROTOCOL))
    flat[f"r{rank}/__structure__"] = torch.frombuffer(blob, dtype=torch.uint8)
    return flat


def unflatten(flat: dict[str, torch.Tensor], rank: int) -> Any:
    """Rebuild what :func:`flatten` took apart (tensors are the ones in ``flat``)."""
    blob = flat[f"r{rank}/__structure__"].numpy().tobytes()
    structure = pickle.loads(blob)  # a checkpoint is trusted input, as with torch.load

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            if set(obj) == {_TENSOR}:
                return flat[obj[_TENSOR]]
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        return obj

    return walk(structure)


def replica_device(module: nn.Module) -> torch.device:
    """The one device holding ``module``'s parameters and buffers (the CPU if it has none):
    live mode's data plane (gloo) carries its CPU or CUDA tensors. (A model still on
    ``meta`` is refused too: healing and voting need its values.)

    Raises:
        ConfigError: the model spans several devices, or sits on one gloo cannot carry.

    Example: ``replica_device(net.to("cuda:0"))`` is ``device("cuda", 0)``.
    """
    found = {t.device for t in list(module.parameters()) + list(module.buffers())}
    if len(found) > 1:
        raise ConfigError(f"live mode trains a model held on one device; this one spans "
                          f"{sorted(str(d) for d in found)}: move it with model.to(device)")
    device = found.pop() if found else torch.device("cpu")  # a tensor's cuda has an index
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"live mode's data plane is gloo, which carries CPU and CUDA "
                          f"tensors; the model is on {device}: move it to the CPU or a "
                          "CUDA device (model.to('cuda'))")
    return device


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def collect_rank_state(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                       step: int, extra: Any) -> dict[str, Any]:
    """Everything this rank needs to resume exactly: module, optimizers, algorithm, RNG."""
    algorithm_state = getattr(model, "algorithm_state_dict", None)
    return {"step": int(step), "model": model.state_dict(),
            "optimizers": [opt.state_dict() for opt in optimizers],
            "algorithm": algorithm_state() if callable(algorithm_state) else {},
            "rng": _rng_state(), "extra": extra}


def without_residuals(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` for a *different* rank: error-feedback residuals (the ``"residuals"`` of
    every ``"feedback"`` entry of the algorithm state) zeroed, everything else kept.

    A residual is the part of its own rank's gradients not yet sent: a debt that rank's
    next steps pay. A rank healed from a peer's state must not inherit the peer's, or the
    peer's unsent gradient would be applied twice; with none, the members' pending
    correction stays what the survivors hold. (Momenta and PowerSGD's warm-start Q are
    kept: they estimate the same mean quantity on every rank.)

    >>> import torch
    >>> s = {"algorithm": {"feedback": {"residuals": {"w": torch.ones(2)},
    ...                                 "compressor": {"q": torch.ones(1)}}}}
    >>> fb = without_residuals(s)["algorithm"]["feedback"]
    >>> fb["residuals"]["w"].tolist(), fb["compressor"]["q"].tolist()
    ([0.0, 0.0], [1.0])
    """
    def zeroed(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return torch.zeros_like(obj)
        if isinstance(obj, dict):
            return {k: zeroed(v) for k, v in obj.items()}
        return obj

    def walk(obj: Any, parent: str = "") -> Any:
        if isinstance(obj, dict):
            return {k: zeroed(v) if (parent, k) == _RESIDUALS else walk(v, k)
                    for k, v in obj.items()}
        return obj

    return {**state, "algorithm": walk(state.get("algorithm", {}))}


def residual_tensors(algorithm_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The error-feedback residuals of an algorithm state (the tensors under the
    ``"residuals"`` of every ``"feedback"`` entry, what :func:`without_residuals` zeroes),
    by path, sorted: the same order on every rank. They are the state's own tensors:
    writing into them changes ``algorithm_state``.

    >>> import torch
    >>> s = {"feedback": {"residuals": {"w": torch.ones(2)}, "compressor": {}}}
    >>> residual_tensors(s)["feedback/residuals/w"].tolist()
    [1.0, 1.0]
    """
    found: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str, parent: str) -> None:
        if not isinstance(obj, dict):
            return
        for k, v in obj.items():
            here = f"{path}/{k}" if path else str(k)
            if (parent, k) == _RESIDUALS and isinstance(v, dict):
                found.update({f"{here}/{name}": t for name, t in v.items()
                              if isinstance(t, torch.Tensor)})
            else:
                walk(v, here, str(k))

    walk(algorithm_state, "", "")
    return dict(sorted(found.items()))


def apply_rank_state(state: dict[str, Any], model: nn.Module,
                     optimizers: Sequence[torch.optim.Optimizer], restore_rng: bool) -> None:
    """Load ``state`` (from :func:`collect_rank_state`) into the live objects."""
    model.load_state_dict(state["model"])
    for opt, opt_state in zip(optimizers, state["optimizers"], strict=True):
        opt.load_state_dict(opt_state)
    load_algorithm = getattr(model, "load_algorithm_state_dict", None)
    if callable(load_algorithm):
        load_algorithm(state["algorithm"])
    if restore_rng and state.get("rng") is not None:
        _set_rng_state(state["rng"])


def fingerprint(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
                ) -> dict[str, Any]:
    """What must match between the saving and the loading job (JSON-able)."""
    algorithm = getattr(model, "algorithm", None)
    # Hexagram's wrapper lists its module's own keys, as before its state_dict() took
    # PyTorch DDP's "module." prefix: checkpoints of either version fit (its
    # load_state_dict takes both)
    from hexagram.engine.ddp import DistributedDataParallel

    own = model.module if isinstance(model, DistributedDataParallel) else model
    return {
        "model": [[k, list(v.shape), str(v.dtype)] for k, v in own.state_dict().items()
                  if isinstance(v, torch.Tensor)],
        "optimizers": [[type(o).__name__, [len(g["params"]) for g in o.param_groups]]
                       for o in optimizers],
        "algorithm": None if algorithm is None else getattr(algorithm, "name", ""),
        "algorithm_config": None if algorithm is None else repr(algorithm.config),
    }
