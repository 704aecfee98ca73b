"""The one control collective: how many ranks raised each flag (join, stop, contribute).

Every protocol that lets ranks agree on *whether* to go on (``DistributedDataParallel.join``,
the rounds of the weight algorithms and their ``synchronize()``, the stop of the async
averaging thread) is a sum over ranks of a few 0/1 flags. This is that sum, once: a tiny
``int64`` allreduce on the group's device (:mod:`hexagram.comm.device`). Every rank gets the
same counts, so every rank takes the same decision at the same round.

Example:
    >>> count_flags(comm, active=True, stop=False).wait()   # doctest: +SKIP
    Counts(active=2, stop=0)
"""

from __future__ import annotations

from collections import namedtuple
from functools import lru_cache
from typing import Any

from torch import Tensor

from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.device import control_tensor, group_device

__all__ = ["count_flags"]


def count_flags(comm: Communicator, **flags: bool | Tensor) -> Handle[Any]:
    """Start the sum over ranks of each flag; the result is a named tuple of ints in the
    order of the keyword arguments (e.g. ``counts.active``). Collective: every rank passes
    the same flag names in the same order. A flag may be a 0-d tensor on the group's
    device (a condition found there: it is not read here). The flags' tensor is a device
    copy of a cached one (a host-to-device copy is a sync on CUDA), so the result's read
    is the only host read."""
    counts = _counts_type(tuple(flags))
    values = list(flags.values())
    host = tuple(bool(v) if not isinstance(v, Tensor) else False for v in values)
    key = (host, str(group_device(comm)))
    if key not in _FLAGS:
        _FLAGS[key] = control_tensor(list(host), comm)
    local = _FLAGS[key].clone()
    for i, v in enumerate(values):
        if isinstance(v, Tensor):
            local[i] = v.reshape(())
    total = primitives.allreduce(comm, local, average=False)
    return total.then(lambda t: counts(*(int(v) for v in t.tolist())))


#: (flags, device) -> the flags as a control tensor on that device, made once
_FLAGS: dict[tuple[tuple[bool, ...], str], Tensor] = {}


@lru_cache(maxsize=32)
def _counts_type(names: tuple[str, ...]) -> Any:
    return namedtuple("Counts", names)  # type: ignore[misc]
