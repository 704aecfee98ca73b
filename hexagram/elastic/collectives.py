"""The collectives of a membership's set-up in live mode, woken when the membership fails.

Healing (the newest member's state broadcast to those behind) and the residuals'
re-centring run on the epoch's gloo group before the wrapper exists. A blocking
``torch.distributed`` call there cannot be ended from another thread:
``ProcessGroup.abort()`` does not wake a gloo wait in progress (torch 2.13), so a member
waiting on a peer that left the collective alive (it failed on the dead member's closed
connection and went on to the next membership) waited out the collective timeout while
the others gave up forming the next membership after ``join_timeout``: a stall of 20 s
the chaos soak found after a kill while healing. Here every collective is issued
asynchronously and waited by a :class:`~hexagram.comm.communicator.Communicator`, whose
wait races the work against its abort: live mode's watcher aborts every communicator
when a member's heartbeat goes stale, and the wait raises :class:`CommError` at once.

Example:
    >>> comm = setup_communicator(30.0)                       # doctest: +SKIP
    >>> state = broadcast_object(comm, state, src=0, device=torch.device("cpu"))
    ... # doctest: +SKIP
"""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hexagram.comm.communicator import Communicator
from hexagram.elastic.liveness import peer_failure
from hexagram.engine.checks import model_signature
from hexagram.errors import ModelMismatchError

__all__ = ["all_gather_object", "all_reduce", "broadcast_object", "broadcast_tensors",
           "check_same_model", "setup_communicator"]


def setup_communicator(timeout: float) -> Communicator:
    """A communicator on the current default group (the epoch's) for its set-up: aborted
    with every other one by :func:`hexagram.comm.communicator.abort_all`."""
    return Communicator(None, timedelta(seconds=timeout), name="live-setup")


def _wait(comm: Communicator, work: Any, what: str) -> None:
    """Wait for ``work``; a dead peer, an abort or the timeout raise :class:`CommError`."""
    with peer_failure(what):
        try:
            comm.await_work(work)
        except TimeoutError as exc:  # concurrent.futures' (an alias since 3.11)
            raise RuntimeError(f"no result within {comm.timeout}") from exc


def _encode(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _decode(data: torch.Tensor, device: torch.device) -> Any:
    # weights_only: tensors and plain containers only; no code runs while loading
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location=device,
                      weights_only=True)


def broadcast_object(comm: Communicator, obj: Any, src: int, device: torch.device,
                     what: str = "healing") -> Any:
    """``obj`` of rank ``src`` on every member (tensors, dicts, lists and plain values;
    tensors land on ``device``): ``torch.distributed.broadcast_object_list``, abortable."""
    mine = comm.rank == src
    data = _encode(obj) if mine else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    _wait(comm, dist.broadcast(size, src, async_op=True), what)
    if not mine:
        data = torch.empty(int(size[0]), dtype=torch.uint8)
    _wait(comm, dist.broadcast(data, src, async_op=True), what)
    return obj if mine else _decode(data, device)


def all_gather_object(comm: Communicator, obj: Any, what: str) -> list[Any]:
    """Every member's ``obj`` in rank order (as :func:`broadcast_object`'s), abortable."""
    data = _encode(obj)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(comm.size)]
    _wait(comm, dist.all_gather(sizes, torch.tensor([data.numel()]), async_op=True), what)
    longest = max(int(s[0]) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(comm.size)]
    _wait(comm, dist.all_gather(out, padded, async_op=True), what)
    return [_decode(o[:int(s[0])], torch.device("cpu")) for o, s in zip(out, sizes)]


def all_reduce(comm: Communicator, tensor: torch.Tensor, what: str) -> None:
    """Sum ``tensor`` over the members in place, abortable."""
    _wait(comm, dist.all_reduce(tensor, async_op=True), what)


def broadcast_tensors(comm: Communicator, tensors: list[torch.Tensor], src: int) -> None:
    """Rank ``src``'s ``tensors`` copied into every member's, in place, abortable."""
    with torch.no_grad():
        for t in tensors:
            _wait(comm, dist.broadcast(t.data, src, async_op=True), "the initial broadcast")


def check_same_model(comm: Communicator, module: nn.Module) -> None:
    """Raise :class:`ModelMismatchError` on every member if any member's model differs in
    its parameters' and buffers' names, shapes, dtypes or ``requires_grad`` (the
    wrapper's own check, ``init_sync``, abortable)."""
    mine = model_signature(module)
    sigs = all_gather_object(comm, mine, "checking the members' models")
    bad = [r for r, sig in enumerate(sigs) if sig != sigs[0]]
    if bad:
        raise ModelMismatchError(
            f"live mode: the model on member ranks {bad} differs from rank 0's in its "
            "parameters or buffers (names, shapes, dtypes). Build the same model on every "
            "replica")
