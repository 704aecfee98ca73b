"""Malformed payloads found by collectives, handed to the caller with the sending rank.

A collective that decodes what other ranks sent asks the compressor
(:meth:`~hexagram.compress.base.Compressor.payload_fault`) whether each received payload is
malformed, and hands the 0-d bool flag, with a function that explains it, to a *sink*
(``sink(flag, explain)``; the algorithms pass ``ctx.checks.add``: the flags join the
step's one host read). Nothing here reads the device.

Who learns of a fault:

- gathered payloads (allgather): every rank decodes every rank's payload, the same bytes
  in the same order, so every rank raises at the same step naming the same sender (the
  payload's index in the gathered list is its rank);
- a sum (allreduce of payloads): the sum of a malformed payload is malformed on every
  rank, but the sender cannot be known from a sum: the message says so;
- scatter-gather: only the owner of a chunk decodes the copies the ranks sent of it; an
  owner that found one malformed sends its re-encoded chunk *poisoned* (:func:`poison`:
  NaN in its floating tensors, the culprit's rank in the NaN's bits), so every rank's
  decode of the allgathered chunks flags it and names the culprit. The allgathered
  chunks' flags are queued before the owner's own (which differ from rank to rank), so
  the first fault of a step, the one raised, names the same tensor on every rank.

Example:
    >>> import torch, hexagram.compress as hc
    >>> c, found = hc.get("topk", k=1), []
    >>> ok = c.compress(torch.tensor([1.0, -2.0]))
    >>> bad = ok.from_buffer(torch.tensor([0, 0, 0, 0, 9, 0, 0, 0], dtype=torch.uint8))
    >>> flags = check_gathered(lambda f, e: found.append((bool(f), e())), c, [ok, bad], "b")
    >>> found[0][0], "rank 1" in found[0][1]
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from hexagram.compress.base import Compressor, Payload
from hexagram.errors import MALFORMED, NONFINITE_SUM

__all__ = ["MALFORMED", "FaultSink", "check_gathered", "check_ranks", "check_summed",
           "payload_flags", "poison"]


#: ``sink(flag, explain)``: queue a 0-d bool flag (True: malformed) and its explanation
FaultSink = Callable[[Tensor, Callable[[], str]], None]

_FIX = ("its decoded values were not used. That rank is faulty or hostile, or the bytes "
        "were corrupted in transit: check that every rank runs the same Hexagram version "
        "and configuration, and that rank's host and network")

#: NaN bit patterns whose low bits carry a rank (quiet NaN, sign clear)
_QUIET_NAN = {torch.float32: (torch.int32, 0x7FC00000),
              torch.float64: (torch.int64, 0x7FF8000000000000)}
_RANK_BITS = 1 << 20


def payload_flags(comp: Compressor, payloads: Sequence[Payload]) -> Tensor:
    """(P,) bool: which of ``payloads`` are malformed (no read of the device)."""
    return torch.stack([comp.payload_fault(p).reshape(()) for p in payloads])


def check_gathered(sink: FaultSink | None, comp: Compressor, payloads: Sequence[Payload],
                   what: str, flags: Tensor | None = None) -> Tensor | None:
    """Queue one flag for ``payloads`` (rank ``r``'s at index ``r``): some is malformed.
    The explanation names the first malformed one's rank, or the culprit a poisoned chunk
    names. ``flags``: their :func:`payload_flags`, where already known. Returns the
    per-rank flags ((P,) bool), or None without a sink."""
    if sink is None:
        return None
    if flags is None:
        flags = payload_flags(comp, payloads)

    def explain() -> str:  # runs only on a failure: reads freely
        r = int(flags.int().argmax())
        culprit = _culprit(payloads[r])
        if culprit is not None and culprit != r:
            return (f"{MALFORMED}: {comp.name}: rank {culprit} sent a malformed payload "
                    f"for {what} (reported by rank {r}, which received it); {_FIX}")
        return (f"{MALFORMED}: {comp.name}: rank {r} sent a malformed payload for {what} "
                f"(indices out of range or repeated, or scales or values NaN/Inf or past "
                f"the dtype's range); {_FIX}")

    sink(flags.any(), explain)
    return flags


def check_ranks(sink: FaultSink, flags: Sequence[Tensor | None], name: str,
                what: str) -> Tensor:
    """Queue one flag for payloads a format decodes itself (``flags[r]``: the 0-d flag of
    rank ``r``'s payload, None for this rank's own, never checked); the explanation
    names the first malformed one's rank. Every rank decodes the same gathered bytes, so
    every rank queues the same flag. Returns the (P,) per-rank flags."""
    device = next((f.device for f in flags if f is not None), None)
    per_rank = torch.stack([f.reshape(()) if f is not None else
                            torch.zeros((), dtype=torch.bool, device=device) for f in flags])

    def explain() -> str:  # runs only on a failure: reads freely
        r = int(per_rank.int().argmax())
        return (f"{MALFORMED}: {name}: rank {r} sent a malformed payload for {what} "
                f"(positions past their chunk or repeated, or scales NaN/Inf or past the "
                f"dtype's range); {_FIX}")

    sink(per_rank.any(), explain)
    return per_rank


def check_summed(sink: FaultSink | None, comp: Compressor, summed: Payload,
                 what: str) -> None:
    """Queue the flag of a payload summed over the ranks (allreduce): a sum that holds
    NaN/Inf (a :data:`~hexagram.errors.NONFINITE_SUM`: an honest overflow and a corrupted
    payload look the same there). The sender cannot be known from a sum, and the message
    says so."""
    if sink is None:
        return
    flag = comp.payload_fault(summed)
    sink(flag, lambda: (
        f"{NONFINITE_SUM}: {comp.name}: the sum over the ranks of {what} holds NaN/Inf or "
        "passes its dtype's range, and its values were not used: some rank's gradient held "
        "NaN/Inf or overflowed the wire's dtype, or its payload was corrupted (a sum cannot "
        "name the sender). Lower the learning rate, clip gradients, use bf16 or loss "
        "scaling; or pass on_nonfinite='skip' to skip such steps"))


def poison(payload: Payload, flags: Tensor) -> Payload:
    """``payload`` with every floating tensor set to NaN where some of ``flags`` ((P,)
    bool, per sending rank) holds, the first such rank written into the NaN's low bits
    (read back by the receivers' explanation). Unchanged (bit for bit) where none holds.
    One ``where`` per floating tensor; no read of the device."""
    bad = flags.any()
    culprit = flags.int().argmax()
    out = []
    for t in payload.tensors:
        if t.dtype in _QUIET_NAN:
            ints, base = _QUIET_NAN[t.dtype]
            mark = (culprit.to(ints) + (base + 1)).to(t.device)
            t = torch.where(bad, mark, t.view(ints)).view(t.dtype)
        elif t.is_floating_point():
            t = torch.where(bad, torch.nan, t)
        out.append(t)
    return Payload(tensors=tuple(out), shape=payload.shape, dtype=payload.dtype,
                   meta=payload.meta)


def _culprit(payload: Payload) -> int | None:
    """The rank a poisoned payload names (:func:`poison`), or None (reads the device)."""
    for t in payload.tensors:
        if t.dtype in _QUIET_NAN and t.numel():
            ints, base = _QUIET_NAN[t.dtype]
            first = int(t.reshape(-1)[0].view(ints)) - base - 1
            return first if 0 <= first < _RANK_BITS else None
    return None
