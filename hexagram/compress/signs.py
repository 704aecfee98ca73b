"""One-bit compressors: ``sign`` (signSGD), ``efsign`` (scaled sign) and ``onebit`` (1-bit SGD).

All three send one bit per element, bit-packed (``ceil(n / 8)`` bytes), bit = 1 where
``x >= 0`` (zero counts as positive), plus a small header:

- ``sign``: no header; decodes to +-1 (signSGD, Bernstein et al.). Meant for majority vote:
  the algorithm sums the decoded signs of all ranks and takes the sign. With
  ``scaled=True`` it also sends the header (1,) [rms(x) = ||x||_2 / sqrt(n)] and still
  decodes to +-1; the vote is then scaled by the ranks' mean of those headers
  (:meth:`SignCompressor.vote_scale`), so its update has the L2 norm of a rank's gradient
  (the step the user's learning rate was tuned for), not the learning rate per element.
  (rms, not mean |x|: on digits at SGD lr 0.05, momentum 0.9, 8 epochs, 4 ranks, mean |x|
  reached 81% where allreduce and rms reached 91.5%: the sign spreads the gradient's
  mass evenly, and mean |x| <= rms shrinks the step.)
- ``efsign``: header (1,) [mean |x|]; decodes to ``mean|x| * sign(x)`` (Karimireddy et al.'s
  scaled sign, ``||x||_1 / n``), meant to be wrapped in :class:`ErrorFeedback`.
- ``onebit``: header (2,) [mean of the negative entries, mean of the non-negative ones], the
  reconstruction values of Seide et al.'s 1-bit SGD (also meant for error feedback): each
  half decodes to its own mean, so the sum of the tensor is preserved.

Headers are float32 (float64 for float64 inputs): ``ceil(n/8) + 4`` bytes for ``efsign``
and scaled ``sign``,
``ceil(n/8) + 8`` for ``onebit``. All are deterministic and biased, and ``Aggregation.GATHER``
(sign bits of different ranks cannot be added in packed form).

Example:
    >>> import torch
    >>> from hexagram.compress.signs import OneBitCompressor
    >>> c = OneBitCompressor()
    >>> x = torch.tensor([1.0, 3.0, -2.0, 0.0])
    >>> c.compress(x).nbytes, c.decompress(c.compress(x)).tolist()
    (9, [1.3333333730697632, 1.3333333730697632, -2.0, 1.3333333730697632])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hexagram.compress.base import (
    Aggregation,
    Layout,
    Payload,
    check_compressible,
)
from hexagram.compress.chunks import TableCodedCompressor, code_values, work_dtype
from hexagram.compress.packing import cpu_fast, packed_nbytes
from hexagram.compress.quantize_segments import check_segments
from hexagram.compress.segments import Segments
from hexagram.compress.sign_blocks import decode_blocked, encode_blocked, header_shape
from hexagram.compress.sign_segments import scaled_sign_decode, scaled_sign_encode, sign_encode
from hexagram.config import check_choice, check_int

__all__ = ["EFSignCompressor", "OneBitCompressor", "SignCompressor", "SignConfig",
           "SignVoteConfig"]


@dataclass(frozen=True, kw_only=True)
class SignConfig:
    """Config of the ``efsign`` and ``onebit`` compressors.

    Attributes:
        block: elements sharing one scale (``efsign``) or pair of reconstruction values
            (``onebit``); 0 (default) => one per tensor, the original formats. Smaller =>
            closer to each element's magnitude (less error-feedback staleness), more header
            bytes (:mod:`hexagram.compress.sign_blocks`).

    Example:
        >>> SignConfig(block=512).block
        512
    """

    block: int = 0

    def __post_init__(self) -> None:
        check_int(self, "block", low=0, high=1 << 24)


@dataclass(frozen=True, kw_only=True)
class SignVoteConfig:
    """Config of the ``sign`` compressor.

    Attributes:
        scaled: also send rms(x) (one float32 header per tensor) so a majority vote can be
            scaled by the ranks' mean magnitude (:meth:`SignCompressor.vote_scale`); the
            payload still decodes to +-1.

    Example:
        >>> SignVoteConfig(scaled=True).scaled
        True
    """

    scaled: bool = False

    def __post_init__(self) -> None:
        check_choice(self, "scaled", (True, False))


def _sign_values(payload: Payload, scale: Tensor) -> Tensor:
    """Bit 0 -> ``-scale``, bit 1 -> ``+scale`` (a one-element tensor): ``b * 2s - s``."""
    return code_values(1, scale * 2, -scale, payload.dtype)


class SignCompressor(TableCodedCompressor):
    """signSGD: one bit per element, decodes to +-1 (see the module docstring)."""

    name = "sign"
    aggregation = Aggregation.GATHER
    unbiased = False

    def __init__(self, config: SignVoteConfig | None = None) -> None:
        self.config = config or SignVoteConfig()
        # the signs (a read, a bit written per element) and the decode (an element written);
        # ``scaled`` reads the input once more for its RMS
        self.memory_passes = 3.0 if self.config.scaled else 2.0

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        """((1,) rms if ``scaled``); one sign bit per element, packed."""
        head: Layout = (((1,), work_dtype(dtype)),) if self.config.scaled else ()
        return (*head, ((packed_nbytes(math.prod(shape), 1),), torch.uint8))

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        check_compressible(tensor, self.name)
        # raises on NaN/Inf (checks_finite); unchecked, a NaN/Inf input makes the rms
        # header non-finite (scaled), or the caller's probe of its input sees it
        flat = tensor.detach().reshape(-1)
        return Payload(tensors=sign_encode(self, flat, Segments.of([flat.numel()])),
                       shape=tensor.shape, dtype=tensor.dtype)

    def compress_segments(self, flat: Tensor, segments: Segments,
                          generator: torch.Generator | None = None) -> Payload:
        """The sign bits of the whole buffer (and, ``scaled``, each segment's rms):
        the same ``+-1`` as each segment compressed alone."""
        flat = check_segments(flat, segments, self.name)
        return Payload(tensors=sign_encode(self, flat, segments),
                       shape=torch.Size([segments.numel]), dtype=flat.dtype,
                       meta={"segments": segments})

    def decompress_segments_into(self, payload: Payload, out: Tensor,
                                 add: bool = False) -> Tensor:
        return self.decompress_into(payload, out, add)  # +-1 everywhere: one table

    def code_table(self, payload: Payload) -> tuple[int, Tensor, Tensor]:
        bits = payload.tensors[-1]
        one = torch.ones(1, dtype=work_dtype(payload.dtype), device=bits.device)
        return 1, _sign_values(payload, one), bits

    def vote_scale(self, payloads: Sequence[Payload]) -> Tensor | None:
        """The mean over ``payloads`` (one per rank, rank order) of their rms(x) headers:
        what a majority vote of scaled signs is multiplied by; ``None`` when not ``scaled``.

        Every rank that holds the same payloads in the same order gets the same bits.

        Example:
            >>> c = SignCompressor(SignVoteConfig(scaled=True))
            >>> xs = [torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.tensor([3.0, 3.0, -3.0, 3.0])]
            >>> ps = [c.compress(x) for x in xs]  # rms 1 and 3
            >>> c.vote_scale(ps).tolist()
            [2.0]
        """
        if not self.config.scaled or not payloads:
            return None
        total = payloads[0].tensors[0].clone()
        for p in payloads[1:]:
            total.add_(p.tensors[0])
        return total.div_(len(payloads))


class _ScaledSignCompressor(TableCodedCompressor):
    """Shared by ``efsign`` and ``onebit``: sign bits plus reconstruction values, one set per
    tensor, or per block of ``config.block`` elements (:mod:`hexagram.compress.sign_blocks`:
    decoded by :meth:`decompress_into`, no single code table). Subclasses give the
    per-tensor code table (:meth:`_table`); the headers come from
    :mod:`hexagram.compress.sign_segments`, for one tensor or a bucket."""

    aggregation = Aggregation.GATHER
    unbiased = False
    #: signs and the header's sums in one read (a bit written per element), the decode (an
    #: element written)
    memory_passes = 2.0

    #: reconstruction values per tensor (or per block): efsign 1, onebit 2
    header_values: int = 1

    def __init__(self, config: SignConfig | None = None) -> None:
        self.config = config or SignConfig()

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        """The header (per tensor, or per block of ``block``); one sign bit per element."""
        n = math.prod(shape)
        head = header_shape(self.name, n, self.config.block) if self.config.block else \
            (self.header_values,)
        return ((head, work_dtype(dtype)), ((packed_nbytes(n, 1),), torch.uint8))

    def compress(self, tensor: Tensor, generator: torch.Generator | None = None) -> Payload:
        check_compressible(tensor, self.name)
        flat = tensor.detach().reshape(-1)
        if self.config.block:
            header, bits = encode_blocked(flat, self.config.block, self.name, self.name,
                                          self.checks_finite)
        else:
            header, bits = scaled_sign_encode(self, flat, Segments.of([flat.numel()]))
            header = header.reshape(-1)
        return Payload(tensors=(header, bits), shape=tensor.shape, dtype=tensor.dtype)

    def compress_segments(self, flat: Tensor, segments: Segments,
                          generator: torch.Generator | None = None) -> Payload:
        """Sign bits of the whole buffer, each segment's header (or its blocks')."""
        flat = check_segments(flat, segments, self.name)
        return Payload(tensors=scaled_sign_encode(self, flat, segments),
                       shape=torch.Size([segments.numel]), dtype=flat.dtype,
                       meta={"segments": segments})

    def decompress_segments_into(self, payload: Payload, out: Tensor,
                                 add: bool = False) -> Tensor:
        return scaled_sign_decode(self, payload, out, add)

    def code_table(self, payload: Payload) -> tuple[int, Tensor, Tensor] | None:
        """The per-tensor format's table; None with blocks or segments (a scale each)."""
        if self.config.block or "segments" in payload.meta:
            return None
        return self._table(payload)

    def decompress_into(self, payload: Payload, out: Tensor, add: bool = False) -> Tensor:
        if "segments" in payload.meta:
            return scaled_sign_decode(self, payload, out, add)
        if not self.config.block:
            return super().decompress_into(payload, out, add)
        header, bits = payload.tensors
        return decode_blocked(header, bits, out.numel(), self.config.block, self.name,
                              out.dtype, out, add)

    def _table(self, payload: Payload) -> tuple[int, Tensor, Tensor]:
        raise NotImplementedError


class EFSignCompressor(_ScaledSignCompressor):
    """Scaled sign ``(||x||_1 / n) * sign(x)``, for use with error feedback."""

    name = "efsign"

    def _table(self, payload: Payload) -> tuple[int, Tensor, Tensor]:
        header, bits = payload.tensors
        # 2 * scale overflows: float64. The two table values are +-scale either way (exact
        # in both dtypes), so the device takes float64 without reading which applies
        if not cpu_fast(header) or not bool(torch.isfinite(header * 2).all()):
            header = header.double()
        return 1, _sign_values(payload, header), bits


class OneBitCompressor(_ScaledSignCompressor):
    """1-bit SGD: each sign half decodes to its mean (reconstruction values)."""

    name = "onebit"
    header_values = 2

    def _table(self, payload: Payload) -> tuple[int, Tensor, Tensor]:
        header, bits = payload.tensors
        # bit 0 -> the negative half's mean, bit 1 -> the non-negative half's
        return 1, header.to(payload.dtype), bits
