"""Compressor contract: tensor -> Payload (the bytes that cross the wire) -> tensor.

Compressors know nothing of collectives. An algorithm reads :attr:`Compressor.aggregation`
to decide which collective can carry a compressor's payloads:

- ``Aggregation.SUM``: payload tensors can be summed element-wise in compressed form, so a
  plain allreduce carries them (fp16, bf16, PowerSGD factors).
- ``Aggregation.GATHER``: payloads cannot be summed (top-k indices, sign bits); every rank
  gathers everyone's payload and decompresses/aggregates locally.
- ``Aggregation.SCATTER_GATHER``: payloads of equal-sized chunks can be exchanged with
  all-to-all, decompressed, reduced, recompressed and allgathered (8-bit min-max, QSGD).

Received bytes are not trusted. Every decoder is safe on any bytes of the right size: it
never raises a torch error nor indexes outside its output (indices read from the wire are
clamped into range, sub-byte codes are in range by construction). Whether the decoded
values are to be trusted is a separate question, answered on the device by
:meth:`Compressor.payload_fault`: a 0-d bool tensor, True when the payload is malformed
(an index out of range or repeated where the format forbids it, a NaN/Inf or negative
scale, values that decode past the dtype's range). It reads nothing from the device;
collectives hand it, with the sending rank, to the caller, which joins it to the step's
one host read (:class:`hexagram.algorithms.finite.StepChecks`).

Example:
    >>> import torch
    >>> from hexagram.compress.base import Payload
    >>> p = Payload(tensors=(torch.zeros(4, dtype=torch.uint8),), shape=torch.Size([32]),
    ...             dtype=torch.float32)
    >>> p.nbytes
    4
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from hexagram.compress.faults import any_of, beyond, no_fault
from hexagram.compress.segments import Segments
from hexagram.errors import NonFiniteGradientError

__all__ = [
    "Aggregation",
    "Compressor",
    "Layout",
    "Payload",
    "SeededCompressor",
    "all_finite",
    "check_compressible",
    "check_finite",
    "decompress_via_into",
    "ensure_finite",
    "segment_parts",
]


class Aggregation(enum.Enum):
    """How payloads of a compressor may be combined across ranks (see module docstring)."""

    SUM = "sum"
    GATHER = "gather"
    SCATTER_GATHER = "scatter_gather"


@dataclass(frozen=True)
class Payload:
    """What a compressor puts on the wire.

    Attributes:
        tensors: the tensors actually sent, bit-packed where the format is sub-byte. Their
            shapes depend only on the input's shape and the compressor's config, so ranks can
            exchange them with fixed-size collectives.
        shape: shape of the original tensor.
        dtype: dtype of the original tensor.
        meta: small host-side facts that are *not* sent because both sides know them
            (e.g. ``k``, number of chunks). Anything data-dependent must be in ``tensors``.
    """

    tensors: tuple[Tensor, ...]
    shape: torch.Size
    dtype: torch.dtype
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Real wire size: the bytes of every tensor in :attr:`tensors`."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def to_buffer(self) -> Tensor:
        """All payload tensors as one contiguous uint8 buffer (for byte-level collectives)."""
        parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in self.tensors]
        if not parts:
            return torch.empty(0, dtype=torch.uint8)
        return torch.cat(parts)

    def from_buffer(self, buffer: Tensor) -> Payload:
        """A payload with this one's layout whose tensors are read from ``buffer``.

        ``buffer`` is a uint8 tensor of exactly :attr:`nbytes` bytes, e.g. received from a
        peer that packed a payload of the same layout with :meth:`to_buffer`.
        """
        if buffer.dtype != torch.uint8 or buffer.numel() != self.nbytes:
            raise ValueError(
                f"buffer must be uint8 with {self.nbytes} bytes, got {buffer.dtype} "
                f"with {buffer.numel()} elements"
            )
        out: list[Tensor] = []
        offset = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            part = buffer[offset : offset + n]
            if part.storage_offset() % t.element_size():
                # a uint8 slice can only be viewed as a wider dtype at an aligned offset
                # (e.g. a 3-byte bit field before a float32 scale): copy the few bytes
                part = part.clone()
            out.append(part.view(t.dtype).reshape(t.shape))
            offset += n
        return replace(self, tensors=tuple(out))


#: shape and dtype of each tensor of a payload, in the payload's order
Layout = tuple[tuple[tuple[int, ...], torch.dtype], ...]


class Compressor(ABC):
    """Base class of compressors: ``compress(tensor) -> Payload``, ``decompress(payload)``.

    Contract:
        - ``decompress(compress(x))`` has ``x``'s shape and dtype.
        - ``compress`` is pure given its input and ``generator`` (stochastic compressors draw
          only from ``generator``; with ``None`` they use a generator seeded from their
          config, so results are reproducible).
        - ``Payload.nbytes`` is the real wire size.
    """

    #: name in the registry (``hexagram.compress.get(name)``)
    name: str = ""
    #: how payloads combine across ranks; read by algorithms, never guessed
    aggregation: Aggregation = Aggregation.GATHER
    #: True where E[decompress(compress(x))] == x
    unbiased: bool = False
    #: True where summing payloads tensor by tensor gives the payload of the sum (fp16);
    #: False for SUM formats that need a protocol between sums (PowerSGD's P then Q)
    payload_sums_elementwise: bool = True
    #: the frozen config dataclass the compressor was built from
    config: Any = None
    #: passes over a 4-byte gradient element its encode + decode make through memory (reads
    #: and writes), which the planner prices at the device's memory rate; ``None``: not
    #: declared (the planner does not price algorithms built on it)
    memory_passes: float | None = None
    #: True: ``compress`` raises :class:`NonFiniteGradientError` on NaN/Inf input (and a
    #: ValueError where a value overflows the format), which reads the device once per
    #: call. An algorithm that checks its buckets itself, once per step on the device,
    #: sets it False: the compressor then reads nothing and lets NaN/Inf through (they
    #: reach the decoded values, or the algorithm's own probe of its input sees them).
    checks_finite: bool = True

    @abstractmethod
    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        """Encode ``tensor`` into a :class:`Payload`."""

    @abstractmethod
    def decompress(self, payload: Payload) -> Tensor:
        """Decode a :class:`Payload` back to a dense tensor of the original shape/dtype."""

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout | None:
        """Shape and dtype of each tensor :meth:`compress` returns for a tensor of ``shape``
        (at least one element) and floating ``dtype``, from the config alone (no data),
        or ``None`` where the class does not declare its format (callers then compress).
        Priced by :mod:`hexagram.cost.payload_size`; a class that declares it must match
        its real payload (``tests/test_cost_payload_size.py`` checks every registered one).

        >>> import hexagram.compress as hc
        >>> hc.get("fp16").wire_layout((3, 2), torch.float32)
        (((3, 2), torch.float16),)
        """
        return None

    def code_table(self, payload: Payload) -> tuple[int, Tensor, Tensor] | None:
        """``(bits, values, packed)`` for per-tensor formats whose element ``i`` decodes to
        ``values[code_i]`` (``2**bits`` values in the payload's dtype, codes packed as
        :func:`~hexagram.compress.packing.pack_codes` does), else None (the default).
        Lets several ranks' payloads be summed in code space
        (:func:`hexagram.compress.combine.sum_payloads`)."""
        return None

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor:
        """Write ``decompress(payload)`` into ``out`` (``add``: add it to ``out``); return ``out``.

        ``out`` is 1-D with the payload's ``numel`` and dtype. Reducing P payloads into one
        buffer this way avoids P dense temporaries as large as the gradient (each a fresh,
        page-faulting allocation). The default goes through :meth:`decompress`; compressors
        override it to decode straight into ``out``. Same values as :meth:`decompress`.
        """
        dense = self.decompress(payload).reshape(-1)
        return out.add_(dense) if add else out.copy_(dense)

    def payload_fault(self, payload: Payload) -> Tensor:
        """0-d bool on the payload's device: True when ``payload`` (received, possibly
        hostile) is malformed, so its decoded values must not be used. Reads nothing.

        Contract: for any bytes of the payload's layout, a decode (any of the decoders,
        per tensor or per bucket) either gives finite values of the right shape or this
        flag is True; for a payload :meth:`compress` made, the flag is False. A payload
        whose floating tensors hold NaN is always flagged (collectives poison a payload
        that way to pass a fault on).

        The default checks that every floating tensor of the payload (the values, or
        the scales of a sign format) is finite and within the payload dtype's range;
        formats with indices or with scales that multiply codes override it. Payloads
        of :meth:`compress_segments`' per-segment fallback are checked part by part.

        >>> import torch, hexagram.compress as hc
        >>> c = hc.get("fp16")
        >>> p = c.compress(torch.ones(3))
        >>> bool(c.payload_fault(p)), bool(c.payload_fault(p.from_buffer(p.to_buffer() | 0x7e)))
        (False, True)
        """
        if "parts" in payload.meta:
            return any_of([self.payload_fault(p) for p in segment_parts(payload)])
        flags = [beyond(t, payload.dtype) for t in payload.tensors if t.is_floating_point()]
        return any_of(flags) if flags else no_fault(payload.tensors[-1].device)

    # -- several tensors in one call (see hexagram.compress.segments) ---------------------
    def compress_segments(self, flat: Tensor, segments: Segments,
                          generator: torch.Generator | None = None) -> Payload:
        """One payload for the tensors laid end to end in ``flat`` (1-D, ``segments.numel``
        elements), each compressed as :meth:`compress` compresses it alone: per-segment
        scales, norms and top-k (layer-wise compression in one call).

        Contract: :meth:`decompress_segments_into` of the result gives, segment by segment,
        the values ``decompress(compress(view))`` gives (bit for bit for deterministic
        formats; for stochastic ones the same distribution), and ``nbytes`` is at most the
        sum of the per-segment payloads' (a format may pack across segment boundaries).
        The payload's ``meta["segments"]`` is ``segments``; ``shape`` is ``(numel,)``.

        The default compresses segment by segment (a loop of :meth:`compress`) and
        concatenates the payloads' tensors; compressors on the hot path override it with
        whole-buffer kernels.

        Example:
            >>> import torch, hexagram.compress as hc
            >>> from hexagram.compress.segments import Segments
            >>> c, seg = hc.get("fp16"), Segments.of([2, 3])
            >>> p = c.compress_segments(torch.arange(5.0), seg)
            >>> c.decompress_segments_into(p, torch.empty(5)).tolist()
            [0.0, 1.0, 2.0, 3.0, 4.0]
        """
        parts = [self.compress(v, generator) for v in segments.views(flat)]
        return Payload(tensors=tuple(t for p in parts for t in p.tensors),
                       shape=torch.Size([segments.numel]), dtype=flat.dtype,
                       meta={"segments": segments,
                             "parts": tuple(replace(p, tensors=p.tensors[:0]) for p in parts),
                             "counts": tuple(len(p.tensors) for p in parts)})

    def decompress_segments_into(self, payload: Payload, out: Tensor,
                                 add: bool = False) -> Tensor:
        """Decode a :meth:`compress_segments` payload into ``out`` (1-D, ``numel``
        elements; ``add``: add to it); returns ``out``. The default decodes segment by
        segment with :meth:`decompress_into`."""
        segments: Segments = payload.meta["segments"]
        for sub, view in zip(segment_parts(payload), segments.views(out)):
            self.decompress_into(sub, view, add=add)
        return out

    def decompress_segments_sum(self, payloads: Sequence[Payload], out: Tensor,
                                finish: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """``out`` (1-D) := ``finish(sum of the decoded`` :meth:`compress_segments`
        ``payloads, in rank order)``; returns ``out``. The segmented counterpart of
        :func:`hexagram.compress.combine.decode_sum` (which calls it for segmented
        payloads): the decode-and-sum of P ranks' payloads of one bucket.

        The default decodes each payload into ``out`` (adding from the second on) with
        :meth:`decompress_segments_into`: P whole-buffer decodes, whatever the number of
        segments. A format that can sum in code space overrides it (same bits).

        Example:
            >>> import torch, hexagram.compress as hc
            >>> from hexagram.compress.segments import Segments
            >>> c, seg = hc.get("fp16"), Segments.of([1, 2])
            >>> p = c.compress_segments(torch.ones(3), seg)
            >>> c.decompress_segments_sum([p, p], torch.empty(3), lambda t: t.div_(2)).tolist()
            [1.0, 1.0, 1.0]
        """
        for i, p in enumerate(payloads):
            self.decompress_segments_into(p, out, add=i > 0)
        return out if finish is None else finish(out)

    def state_dict(self) -> dict[str, Any]:
        """Compressor state needed to resume exactly (RNG state, warm-start factors)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (no-op default)
        """Restore what :meth:`state_dict` returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def segment_parts(payload: Payload) -> list[Payload]:
    """The per-segment payloads of a :meth:`Compressor.compress_segments` payload made
    segment by segment (``meta["parts"]``, the default)."""
    tensors = iter(payload.tensors)
    return [replace(part, tensors=tuple(next(tensors) for _ in range(count)))
            for part, count in zip(payload.meta["parts"], payload.meta["counts"])]


def decompress_via_into(compressor: Compressor, payload: Payload) -> Tensor:
    """:meth:`Compressor.decompress` of compressors that implement ``decompress_into``."""
    out = torch.empty(payload.shape.numel(), dtype=payload.dtype,
                      device=payload.tensors[-1].device)
    return compressor.decompress_into(payload, out).view(payload.shape)


def check_compressible(tensor: Tensor, who: str) -> None:
    """Raise a clear error for tensors no compressor accepts (not a tensor, integer, empty).

    Non-finite values are checked by each compressor with :func:`ensure_finite` (from a
    reduction it computes anyway) or :func:`check_finite`.

    Args:
        tensor: the tensor about to be compressed.
        who: name used in the message (compressor or parameter name).
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{who}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(
            f"{who}: cannot compress a {tensor.dtype} tensor; compressors take floating-point "
            "gradients or weights (cast with .float() first)"
        )
    if tensor.numel() == 0:
        raise ValueError(f"{who}: cannot compress an empty tensor (numel == 0)")


def all_finite(tensor: Tensor) -> bool:
    """True if ``tensor`` holds no NaN or Inf.

    A finite sum proves it (NaN and Inf propagate through a sum) in one read-only pass
    that allocates nothing: 40x cheaper than ``isfinite(t).all()`` on 10M float32 values.
    Finite values can overflow the sum, so a non-finite sum only triggers the exact check.
    """
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def check_finite(tensor: Tensor, who: str) -> None:
    """Raise :class:`NonFiniteGradientError` if ``tensor`` holds NaN or Inf."""
    if not all_finite(tensor):
        raise NonFiniteGradientError(
            f"{who}: the tensor holds NaN or Inf; compressing it would silently corrupt every "
            "rank's result. Find the step/parameter that produced it (lower the learning "
            "rate, clip gradients or use a loss scaler) before compressing"
        )


def ensure_finite(tensor: Tensor, probe: Tensor, who: str) -> None:
    """Cheap finiteness check: ``probe`` is a small reduction of ``tensor`` already computed.

    NaN and Inf propagate through sums, norms, minima and maxima, so a finite ``probe``
    proves a finite ``tensor`` at no extra cost. A non-finite probe triggers the full check
    (the probe may also have overflowed on finite data, e.g. a float32 sum of squares).
    """
    if not bool(torch.isfinite(probe).all()):
        check_finite(tensor, who)


class SeededCompressor(Compressor):
    """Base of stochastic compressors: an own generator per device, seeded from ``seed``.

    ``compress(x, generator=g)`` draws only from ``g``; with ``None`` it draws from the
    compressor's generator for ``x.device``, created from ``seed`` and saved in
    :meth:`state_dict`, so a run resumed from a checkpoint draws the same numbers.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def generator_for(self, tensor: Tensor, generator: torch.Generator | None) -> torch.Generator:
        """``generator`` if given, else this compressor's own generator for the device."""
        if generator is not None:
            return generator
        key = str(tensor.device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=tensor.device).manual_seed(self.seed)
        return self._generators[key]

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed,
                "generators": {k: g.get_state() for k, g in self._generators.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self._generators = {}
        for key, rng_state in state["generators"].items():
            g = torch.Generator(device=key)
            g.set_state(rng_state)
            self._generators[key] = g
