"""Fused Triton kernels of the wire formats, for CUDA tensors.

Each function here does in one or two kernels what the eager code CUDA takes does in many
(:mod:`hexagram.compress.quantize`, :mod:`~hexagram.compress.codes`,
:mod:`~hexagram.compress.sign_bits`, :mod:`~hexagram.compress.chunks`), and returns the
same payload tensors, bit for bit: the same arithmetic in the same order and dtypes, every
op rounded on its own (no fused multiply-add), the same random draws. Eager torch stays
the CPU path and the reference.

Dispatch: :func:`available` says whether the kernels can take given tensors (Triton
importable, and the tensors on CUDA, or on the CPU after :func:`use_interpreter`); every
other function raises :class:`KernelUnavailable` where it is False. The compressors' device
paths call :func:`dispatch` (:func:`available`, :data:`DISPATCH` on, dense tensors) and
keep the eager code below it. Importing this package never imports Triton: the kernel
modules are imported on first use.

Functions (``n`` elements, codes packed as :func:`~hexagram.compress.packing.pack_codes`
does: code ``i`` of ``b`` bits at bits ``[i b, (i + 1) b)`` of a little-endian stream):

- :func:`minmax_encode` ``(flat, chunk, bits)`` -> ``(header, codes)``: the payload tensors
  of ``minmax8`` (bits 8) / ``minmax4`` (bits 4).
- :func:`stochastic_codes`: :func:`hexagram.compress.codes.stochastic_codes` (``qsgd``,
  ``terngrad``), same signature, same draws from ``gen``.
- :func:`sign_bits` ``(flat)`` -> the packed sign bits of ``sign`` / ``efsign`` / ``onebit``.
- :func:`decode_table`, :func:`decode_affine`: :mod:`hexagram.compress.chunks`' decoders,
  same signatures (every decoder of the formats above goes through one of them).
- :func:`finite_clean` ``(flat, starts)`` -> per-segment flags: the bucket's NaN/Inf check.

Example (wiring into a compressor):
    >>> from hexagram.compress import kernels
    >>> def codes_of(flat, chunk, scale, levels, gen, pre):  # doctest: +SKIP
    ...     if kernels.available(flat, scale):
    ...         return kernels.stochastic_codes(flat, chunk, scale, levels, gen, pre)
    ...     return codes.stochastic_codes(flat, chunk, scale, levels, gen, pre)
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from types import ModuleType

import torch
from torch import Tensor

from hexagram.compress.kernels.checks import (
    check_chunks,
    check_flat,
    check_out,
    check_packed,
    check_starts,
)

__all__ = [
    "DISPATCH",
    "KernelUnavailable",
    "available",
    "decode_affine",
    "decode_table",
    "dispatch",
    "draw_dither",
    "finite_clean",
    "minmax_encode",
    "sign_bits",
    "stochastic_codes",
    "use_interpreter",
]

_BITS = "hexagram.compress.kernels.triton_bits"

#: False keeps the compressors and the engine's guard on the eager code even where the
#: kernels are available (:func:`dispatch`): the reference the tests compare them with
DISPATCH = True


class KernelUnavailable(RuntimeError):
    """The fused kernels cannot take these tensors (no Triton, or not CUDA tensors): call
    the eager code instead (check :func:`available` first)."""


@functools.cache
def _triton_importable() -> bool:
    try:
        importlib.import_module("triton.language")
    except Exception:  # not installed, or a build that cannot load here
        return False
    return True


def _interpreted() -> bool:
    """Whether :func:`use_interpreter` chose Triton's interpreter in this process (the
    kernels imported interpreted). ``TRITON_INTERPRET=1`` inherited from a parent process
    alone does not count: the ranks a test spawns keep the eager code on their CPUs."""
    bits = sys.modules.get(_BITS)
    return bits is not None and bool(bits.INTERPRETED)


def available(*tensors: Tensor) -> bool:
    """True when the kernels can take ``tensors``: Triton importable, every tensor on one
    device, a CUDA one, or the CPU with the kernels in Triton's interpreter
    (:func:`use_interpreter` called in this process).

    Example:
        >>> import torch
        >>> available(torch.ones(3, device="cuda"))  # doctest: +SKIP
        True
    """
    if not tensors or len({t.device for t in tensors}) != 1:
        return False
    device = tensors[0].device
    if device.type == "cpu" and not _interpreted():
        return False
    if device.type not in ("cpu", "cuda"):
        return False
    return _triton_importable()


def dispatch(*tensors: Tensor) -> bool:
    """True where the compressors take the kernels for ``tensors`` (the inputs and outputs
    a kernel indexes as flat memory): :data:`DISPATCH` on, :func:`available`, and every
    tensor non-empty and contiguous (a strided view or an empty tensor takes the eager
    code). Host facts only; on a CPU-only run it never imports Triton (unless
    :func:`use_interpreter` chose the interpreter).

    Example:
        >>> dispatch(torch.ones(3))  # a CPU tensor outside the interpreter
        False
    """
    return DISPATCH and all(t.numel() > 0 and t.is_contiguous() for t in tensors) \
        and available(*tensors)


def use_interpreter() -> None:
    """Run the kernels in Triton's interpreter (numpy on CPU tensors; slow: for tests).

    Sets ``TRITON_INTERPRET=1`` for the rest of the process: Triton decorates its own
    library (``tl.sum``...) when imported and checks the switch again while running, so
    the interpreter must be the process's only mode, chosen before anything imports
    Triton. Raises :class:`KernelUnavailable` without Triton, RuntimeError if Triton was
    already imported compiled (start a fresh process).
    """
    if importlib.util.find_spec("triton") is None:
        raise KernelUnavailable("triton is not installed: pip install -e '.[dev]'")
    if "triton" in sys.modules and not _triton_interpreted():
        raise RuntimeError("triton is already imported compiled in this process; call "
                           "use_interpreter() before anything imports triton")
    os.environ["TRITON_INTERPRET"] = "1"
    importlib.import_module(_BITS)


def _triton_interpreted() -> bool:
    """Whether the imported Triton decorated its library for the interpreter."""
    language = sys.modules.get("triton.language")
    return language is not None and type(language.sum).__name__ == "InterpretedFunction"


def _module(name: str, *tensors: Tensor) -> ModuleType:
    """The kernel module ``name``, after checking :func:`available` for ``tensors``."""
    if not available(*tensors):
        where = sorted({str(t.device) for t in tensors})
        raise KernelUnavailable(
            f"fused kernels need triton and CUDA tensors on one device (got {where}, triton "
            f"{'importable' if _triton_importable() else 'missing'}); use the eager code")
    return importlib.import_module(f"{__name__}.{name}")


def minmax_encode(flat: Tensor, chunk: int, bits: int, recip: bool | None = None,
                  packed: bool = True) -> tuple[Tensor, Tensor]:
    """The payload tensors of ``minmax8`` (``bits=8``) or ``minmax4`` (``bits=4``).

    ``flat``: 1-D contiguous float16/bfloat16/float32/float64. Returns ``header`` (G, 2)
    ``[min, step]`` per chunk of ``chunk`` elements (G = ceil(n / chunk); float32, float64
    for float64 input; NaN/Inf in a chunk make its row non-finite, so the header is a
    finiteness probe) and the packed codes ``trunc((x - min) / step + 0.5)``
    (``ceil(n * bits / 8)`` uint8), as ``MinMax8Compressor.compress`` on the device
    path. ``recip`` (default: ``flat.is_cuda``): divide by ``(2**bits - 1) / 2`` as torch
    divides a tensor by a Python number on CUDA, a multiplication by its reciprocal
    (``False``: a true division, as the CPU does). Two kernels: one reads each chunk for
    the header, one reads the elements again and writes the codes.

    Example:
        >>> header, codes = minmax_encode(torch.linspace(-1, 1, 2048, device="cuda"),
        ...                               1024, 8)  # doctest: +SKIP
        >>> header.shape, codes.shape  # doctest: +SKIP
        (torch.Size([2, 2]), torch.Size([2048]))
    """
    check_flat(flat, "minmax_encode")
    check_chunks(chunk, "chunk")
    if bits not in (4, 8):
        raise ValueError(f"minmax_encode: bits must be 4 or 8, got {bits}")
    mod = _module("triton_quant", flat)
    return mod.launch_minmax(flat, chunk, bits, flat.is_cuda if recip is None else recip,
                             bits if packed else 8)


def draw_dither(gen: torch.Generator, n: int, device: torch.device) -> Tensor:
    """The ``n`` int16 dithers :func:`hexagram.compress.codes.stochastic_codes` draws for
    ``n`` elements in one block (the device's block): the low 16-bit quarters of
    ``ceil(n / 4)`` words from :func:`~hexagram.compress.packing.random_words`."""
    from hexagram.compress.packing import random_words

    words = random_words(gen, torch.device(device))(-(-n // 4))
    return words.to(device).view(torch.int16)[:n]


def stochastic_codes(flat: Tensor, chunk: int, scale: Tensor, levels: int,
                     gen: torch.Generator, pre: Tensor | None = None,
                     packed: bool = True) -> Tensor:
    """:func:`hexagram.compress.codes.stochastic_codes` in one kernel: packed codes
    ``trunc(clamp(x [* pre[c]] * scale[c] + s + 0.5 + 2**-17 + r / 2**16, 0, 2 s))`` of
    ``b = (2 s).bit_length()`` bits, ``c`` each element's chunk, ``r`` its int16 dither
    (:func:`draw_dither` from ``gen``: the same draws, so the same bits).

    ``scale`` (and ``pre``): one value per chunk, float32 or float64 (the arithmetic's
    dtype). Used by ``qsgd`` (chunks of ``bucket_size``, ``scale = s / norm``) and
    ``terngrad`` (one chunk of ``n``, ``s = 1``, ``scale = 1 / max|x|``).
    ``packed=False``: one code per byte, unpacked (as the eager function's).

    Example:
        >>> g = torch.Generator(device="cuda").manual_seed(0)  # doctest: +SKIP
        >>> x = torch.randn(1000, device="cuda")  # doctest: +SKIP
        >>> scale = (1 / x.abs().max()).reshape(1)  # doctest: +SKIP
        >>> stochastic_codes(x, 1000, scale, 1, g).shape  # doctest: +SKIP
        torch.Size([250])
    """
    check_flat(flat, "stochastic_codes")
    check_chunks(chunk, "chunk")
    if not 1 <= levels <= 127:
        raise ValueError(f"stochastic_codes: levels must be in [1, 127], got {levels}")
    groups = -(-flat.numel() // chunk)
    scale = _per_chunk(scale, groups, "scale")
    pre = None if pre is None else _per_chunk(pre, groups, "pre", scale.dtype)
    mod = _module("triton_quant", flat, scale)
    dither = draw_dither(gen, flat.numel(), flat.device)
    return mod.launch_stochastic(flat, chunk, scale, levels, dither, pre,
                                 None if packed else 8)


def _per_chunk(t: Tensor, groups: int, what: str, dtype: torch.dtype | None = None
               ) -> Tensor:
    """``t`` as a contiguous 1-D tensor of at least ``groups`` values (a single value is
    expanded), checking its dtype."""
    if t.dtype not in (torch.float32, torch.float64) or (dtype is not None and
                                                          t.dtype != dtype):
        raise ValueError(f"{what} must be float32 or float64 (and match scale), got {t.dtype}")
    flat = t.reshape(-1)
    if flat.numel() == 1 and groups > 1:
        flat = flat.expand(groups)
    if flat.numel() < groups:
        raise ValueError(f"{what} holds {flat.numel()} values, {groups} chunks need one each")
    return flat.contiguous()


def sign_bits(flat: Tensor) -> Tensor:
    """Packed sign bits of ``flat`` (1-D contiguous float): ``ceil(n / 8)`` uint8, bit 1
    where ``x >= 0`` (-0.0 too; NaN gives 0), element ``i`` at bit ``i % 8`` of byte
    ``i // 8``: the bits of :func:`hexagram.compress.sign_bits.encode_signs` (whose sums
    stay eager: float64 reductions in torch's order).

    Example:
        >>> sign_bits(torch.tensor([1.0, -2.0, 0.0], device="cuda")).tolist()  # doctest: +SKIP
        [5]
    """
    check_flat(flat, "sign_bits")
    return _module("triton_signs", flat).launch_signs(flat)


def decode_table(packed: Tensor, bits: int, n: int, values: Tensor, out: Tensor,
                 add: bool = False, chunk: int = 0, scale: Tensor | None = None) -> Tensor:
    """:func:`hexagram.compress.chunks.decode_table` in one kernel: ``out`` (1-D contiguous,
    ``n``) := ``values[code]`` (``add``: ``+=``), times ``scale[i // chunk]`` when given.
    ``values`` (``2**bits``) and ``scale`` in ``out``'s dtype. Any width of 1 to 8 bits.
    Returns ``out``.

    Example (``sign``: bit 0 -> -1, bit 1 -> +1):
        >>> out = torch.empty(3, device="cuda")  # doctest: +SKIP
        >>> vals = torch.tensor([-1.0, 1.0], device="cuda")  # doctest: +SKIP
        >>> decode_table(torch.tensor([5], dtype=torch.uint8, device="cuda"), 1, 3, vals,
        ...              out).tolist()  # doctest: +SKIP
        [1.0, -1.0, 1.0]
    """
    check_packed(packed, bits, n, "decode_table")
    check_out(out, n, "decode_table")
    if values.numel() < 1 << bits or values.dtype != out.dtype:
        raise ValueError(f"decode_table: values must hold {1 << bits} values of out's dtype "
                         f"{out.dtype}, got {values.numel()} of {values.dtype}")
    if scale is not None:
        check_chunks(chunk, "chunk (with scale)")
        scale = _per_chunk(scale, -(-n // chunk), "scale", out.dtype)
    mod = _module("triton_decode", packed, out)
    return mod.launch_table(packed, bits, n, values.reshape(-1).contiguous(), out, add, chunk,
                            scale)


def decode_affine(packed: Tensor, bits: int, n: int, chunk: int, scale: Tensor,
                  offset: Tensor | None, dtype: torch.dtype, out: Tensor | None = None,
                  add: bool = False, post: Tensor | None = None) -> Tensor:
    """:func:`hexagram.compress.chunks.decode_affine` in one kernel: ``out`` (1-D contiguous,
    ``n`` elements; allocated as ``dtype`` when None) := ``(code * scale[c] + offset[c]) *
    post[c]`` computed in ``scale``'s dtype (float32/float64; ``offset`` and ``post`` the
    same), rounded to ``out``'s dtype (``add``: added to it). Returns ``out``.

    Example (``minmax8``, one chunk ``[lo=-1, step=0.5]``):
        >>> codes = torch.tensor([0, 2, 4], dtype=torch.uint8, device="cuda")  # doctest: +SKIP
        >>> one = torch.ones(1, device="cuda")  # doctest: +SKIP
        >>> decode_affine(codes, 8, 3, 3, one / 2, -one, torch.float32).tolist()  # doctest: +SKIP
        [-1.0, 0.0, 1.0]
    """
    check_packed(packed, bits, n, "decode_affine")
    check_chunks(chunk, "chunk")
    groups = -(-n // chunk)
    scale = _per_chunk(scale, groups, "scale")
    offset = None if offset is None else _per_chunk(offset, groups, "offset", scale.dtype)
    post = None if post is None else _per_chunk(post, groups, "post", scale.dtype)
    if out is None:
        out = torch.empty(n, dtype=dtype, device=packed.device)
    check_out(out, n, "decode_affine")
    mod = _module("triton_decode", packed, scale, out)
    return mod.launch_affine(packed, bits, n, chunk, scale, offset, out, add, post)


def finite_clean(flat: Tensor, starts: Tensor, out: Tensor | None = None) -> Tensor:
    """Per-segment NaN/Inf check of a bucket, cleaning it: one kernel reads ``flat`` (1-D
    contiguous float, the segments end to end) once, writes 0 over each NaN/Inf (and
    nothing else), and returns ``bad`` (bool, one per segment): True where segment ``i``
    (``flat[starts[i]:starts[i + 1]]``, the last to the end) held a NaN/Inf, i.e.
    ``~isfinite(segment).all()``, then ``nan_to_num_(nan=0, posinf=0, neginf=0)``.

    ``starts``: int64, increasing, ``starts[0] == 0`` (as
    :meth:`hexagram.compress.segments.Segments.device_offsets`; not checked on the device).
    ``out``: a bool tensor of ``len(starts)`` to write the flags into (zeroed first).
    Nothing is read back to the host.

    Example:
        >>> x = torch.tensor([1.0, float("nan"), 2.0, 3.0], device="cuda")  # doctest: +SKIP
        >>> starts = torch.tensor([0, 2], device="cuda")  # doctest: +SKIP
        >>> finite_clean(x, starts).tolist(), x.tolist()  # doctest: +SKIP
        ([True, False], [1.0, 0.0, 2.0, 3.0])
    """
    check_flat(flat, "finite_clean")
    check_starts(starts, flat.numel())
    if out is None:
        out = torch.empty(starts.numel(), dtype=torch.bool, device=flat.device)
    elif out.dtype != torch.bool or out.shape != (starts.numel(),) or not out.is_contiguous():
        raise ValueError(f"finite_clean: out must be a contiguous bool tensor of "
                         f"{starts.numel()} flags, got {out.dtype} {tuple(out.shape)}")
    mod = _module("triton_finite", flat, starts, out)
    return mod.launch_finite(flat, starts, out)
