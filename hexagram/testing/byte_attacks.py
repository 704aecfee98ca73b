"""Byte-level attacks: a Byzantine rank's payloads corrupted on the wire, sizes unchanged.

The value attacks (:func:`hexagram.testing.attacks.corrupt`) send a wrong *vector*; these
send wrong *bytes*, which only a decoder meets: :func:`corrupt_payload` rewrites the
tensors of a :class:`~hexagram.compress.base.Payload` by dtype, keeping every shape and
dtype (the wire size is the same, so no collective notices), and
:class:`CorruptingCompressor` applies it after the inner compressor's ``compress`` /
``compress_segments`` on the attacking ranks.

- ``malformed``: every tensor's bytes replaced by random bytes (bool tensors: random 0/1);
- ``index_out_of_range``: every signed integer tensor (top-k's indices) set past the
  encoded tensor's length (``numel`` up to ``2 numel``, clamped to the dtype's maximum);
  a payload without one is left alone;
- ``nan_scale``: the floating tensors that scale the rest (scales, norms, minima and
  maxima, sparse values: fewer elements than the encoded tensor) set to NaN; a dense
  floating format (fp16) has no such tensor, and its values are set to NaN instead.

Only what the rank *contributes* is corrupted: encodes made on the thread that built the
wrapper (the training thread). The re-encoding of a reduced shard on the communicator's
thread (scatter-gather's and ``robust``'s second leg) relays an aggregate every rank
trusts; corrupting it is another threat model (a dishonest aggregator), not this one.

Example:
    >>> import torch, hexagram.compress as hc
    >>> c = CorruptingCompressor(hc.get("topk", density=0.5), "index_out_of_range")
    >>> p = c.compress(torch.arange(8.0))
    >>> [int(t.min()) >= 8 for t in p.tensors if t.dtype == torch.int64 or
    ...  t.dtype == torch.int32]
    [True]
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from hexagram.compress.base import Compressor, Layout, Payload
from hexagram.compress.segments import Segments

__all__ = ["BYTE_ATTACKS", "CorruptingCompressor", "corrupt_payload", "corrupt_tensors"]

BYTE_ATTACKS = ("malformed", "index_out_of_range", "nan_scale")
_INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)


def _random_bytes(t: Tensor, generator: torch.Generator | None) -> Tensor:
    """A tensor shaped and typed like ``t`` whose bytes are random (bool: 0 or 1)."""
    gen_device = generator.device if generator is not None else t.device
    if t.dtype == torch.bool:
        return torch.randint(0, 2, t.shape, generator=generator,
                             device=gen_device).bool().to(t.device)
    n = t.numel() * t.element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator,
                        device=gen_device).to(t.device)
    return raw.view(t.dtype).reshape(t.shape)


def _past_end(t: Tensor, numel: int, generator: torch.Generator | None) -> Tensor:
    """``t``'s shape and dtype, every element in ``[numel, 2 numel)`` (clamped to the
    dtype's range): an index past the tensor it claims to address."""
    gen_device = generator.device if generator is not None else t.device
    top = torch.iinfo(t.dtype).max
    low = min(numel, top)
    high = max(low + 1, min(2 * numel, top))
    return torch.randint(low, high, t.shape, generator=generator, device=gen_device,
                         dtype=torch.int64).to(device=t.device, dtype=t.dtype)


def corrupt_tensors(attack: str, tensors: Sequence[Tensor], numel: int,
                    generator: torch.Generator | None = None) -> tuple[Tensor, ...]:
    """``tensors`` (a payload's, encoding ``numel`` elements) corrupted by ``attack``:
    new tensors, same shapes and dtypes; those the attack does not touch are returned as
    they are."""
    check_byte_attack(attack)
    if attack == "malformed":
        return tuple(_random_bytes(t, generator) for t in tensors)
    if attack == "index_out_of_range":
        return tuple(_past_end(t, numel, generator) if t.dtype in _INDEX_DTYPES else t
                     for t in tensors)
    floats = [i for i, t in enumerate(tensors) if t.is_floating_point()]
    scales = [i for i in floats if tensors[i].numel() < numel] or floats
    return tuple(torch.full_like(t, float("nan")) if i in scales else t
                 for i, t in enumerate(tensors))


def corrupt_payload(attack: str, payload: Payload,
                    generator: torch.Generator | None = None) -> Payload:
    """``payload`` with its tensors corrupted by ``attack`` (see the module docstring);
    ``nbytes`` and the layout are unchanged, so it crosses the wire as the real one would.

    Example:
        >>> import torch, hexagram.compress as hc
        >>> p = hc.get("qsgd").compress(torch.randn(64))
        >>> bad = corrupt_payload("nan_scale", p)
        >>> bad.nbytes == p.nbytes, any(t.isnan().any().item() for t in bad.tensors)
        (True, True)
    """
    numel = 1
    for s in payload.shape:
        numel *= int(s)
    return replace(payload, tensors=corrupt_tensors(attack, payload.tensors, numel, generator))


def check_byte_attack(name: str) -> None:
    """Raise ``ValueError`` listing the byte attacks when ``name`` is not one."""
    if name not in BYTE_ATTACKS:
        raise ValueError(f"unknown byte attack {name!r}; valid: {', '.join(BYTE_ATTACKS)}")


class CorruptingCompressor(Compressor):
    """``inner``'s payloads, corrupted by ``attack`` after every encode made on the thread
    that built this wrapper; decoding, facts and state are ``inner``'s.

    Example:
        >>> import torch, hexagram.compress as hc
        >>> c = CorruptingCompressor(hc.get("fp16"), "malformed", seed=1)
        >>> c.compress(torch.zeros(4)).nbytes == hc.get("fp16").compress(torch.zeros(4)).nbytes
        True
    """

    def __init__(self, inner: Compressor, attack: str, seed: int = 0,
                 device: torch.device | str | None = None, keep_own: bool = False) -> None:
        check_byte_attack(attack)
        self.inner = inner
        #: decode the last payload this wrapper encoded as it really was (for the
        #: attacker's error feedback, which decodes what it just encoded: see _honest);
        #: off for the wrapper that decodes what arrives (an in-place sum reuses the
        #: sent payload's tensors)
        self.keep_own = keep_own
        self.attack = attack
        self.generator = torch.Generator(device=device or "cpu").manual_seed(seed)
        self._thread = threading.get_ident()
        self.calls = 0  # payloads corrupted so far
        self._own: tuple[Payload, Payload] | None = None  # the last (sent, real) pair
        for fact in ("name", "aggregation", "unbiased", "payload_sums_elementwise", "config",
                     "memory_passes"):
            setattr(self, fact, getattr(inner, fact))

    @property  # type: ignore[override]
    def checks_finite(self) -> bool:  # type: ignore[override]
        return self.inner.checks_finite

    @checks_finite.setter
    def checks_finite(self, value: bool) -> None:
        self.inner.checks_finite = value

    def corrupt(self, payload: Payload) -> Payload:
        """``payload`` as this attacker puts it on the wire (for an algorithm that encodes
        with compressors of its own: see
        :func:`hexagram.testing.attacks.corrupt_compressors`)."""
        return self._corrupt(payload)

    def _corrupt(self, payload: Payload) -> Payload:
        if threading.get_ident() != self._thread:
            return payload  # a relayed aggregate (second leg): see the module docstring
        self.calls += 1
        bad = corrupt_payload(self.attack, payload, self.generator)
        self._own = (bad, payload)
        return bad

    def _honest(self, payload: Payload) -> Payload:
        """The attacker decodes its own last payload as it really was (its error-feedback
        residual stays its own business): only the wire carries the corruption."""
        own = self._own
        if not self.keep_own or own is None or len(payload.tensors) != len(own[0].tensors):
            return payload
        if all(a is b for a, b in zip(payload.tensors, own[0].tensors)):
            return own[1]
        return payload

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        return self._corrupt(self.inner.compress(tensor, generator))

    def compress_segments(self, flat: Tensor, segments: Segments,
                          generator: torch.Generator | None = None) -> Payload:
        return self._corrupt(self.inner.compress_segments(flat, segments, generator))

    def decompress(self, payload: Payload) -> Tensor:
        return self.inner.decompress(self._honest(payload))

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor:
        return self.inner.decompress_into(self._honest(payload), out, add)

    def decompress_segments_into(self, payload: Payload, out: Tensor,
                                 add: bool = False) -> Tensor:
        return self.inner.decompress_segments_into(self._honest(payload), out, add)

    def decompress_segments_sum(self, payloads: Sequence[Payload], out: Tensor,
                                finish: Any = None) -> Tensor:
        return self.inner.decompress_segments_sum(payloads, out, finish)

    def payload_fault(self, payload: Payload) -> Tensor:
        # the inner format's own check (indices, scales): the base class's would look at
        # the floating tensors only, and the attacker would miss what its peers flag
        return self.inner.payload_fault(payload)

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout | None:
        return self.inner.wire_layout(shape, dtype)

    def code_table(self, payload: Payload) -> tuple[int, Tensor, Tensor] | None:
        return self.inner.code_table(payload)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:  # format-specific helpers (a vote's scale)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
