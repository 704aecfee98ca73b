"""Bit packing of small integer codes, and block-wise encode/decode loops.

A code is an integer in ``[0, 2**bits)`` held in a uint8. ``pack_codes`` stores ``n`` codes
of ``bits`` bits in exactly ``ceil(n * bits / 8)`` bytes, little-endian within each group of
8 codes: 8 codes of ``bits`` bits form one ``8 * bits``-bit word whose low ``bits`` bits are
code 0, and the word's ``bits`` bytes are stored lowest first. Every width from 1 to 8 bits
is supported (QSGD with 3 levels needs 3 bits), all with shifts and ors on uint8/int64
views — no Python loop over elements.

Compressors encode large tensors block by block (:func:`encode_blocks`,
:func:`decode_blocks`): the temporaries of a block of :func:`block_size` elements are
reused and stay in the CPU caches, instead of allocating (and page-faulting) several
tensors as large as the gradient, which costs more than the arithmetic itself. On CUDA a
block is the whole tensor (one pass, one kernel per op); lookup tables are cached per
device.

Example:
    >>> import torch
    >>> codes = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.uint8)
    >>> packed = pack_codes(codes, bits=1)
    >>> packed.tolist(), packed_nbytes(9, 1)
    ([13, 1], 2)
    >>> torch.equal(unpack_codes(packed, bits=1, n=9), codes)
    True
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "CPU_FAST_PATHS",
    "ONE_PASS",
    "block_size",
    "blocks",
    "byte_codes",
    "cpu_fast",
    "decode_blocks",
    "encode_blocks",
    "pack_codes",
    "packed_nbytes",
    "random_words",
    "unpack_codes",
    "unpack_table",
]

#: unit of the block-wise loops' block size: 31 * 1024 elements hold whole chunks of the
#: usual power-of-two chunk sizes up to 1024
BLOCK = 31 * 1024

#: False sends CPU tensors down the code CUDA tensors take instead of the CPU-only fast
#: paths (numpy sign packing, code casts, threshold scans and random bits; decisions that
#: read a tensor, which costs nothing on the CPU): tests flip it (or set the environment
#: variable HEXAGRAM_CPU_FAST_PATHS=0) to check the device path, its host reads and its
#: results, on a CPU
CPU_FAST_PATHS = os.environ.get("HEXAGRAM_CPU_FAST_PATHS", "1") != "0"


def block_size(device: torch.device | None = None) -> int:
    """Elements per block of the block-wise loops on ``device``: 16 * BLOCK (about 500K) on
    the CPU, everything in one pass on an accelerator (:data:`ONE_PASS`).

    CPU: temporaries of a block are reused, so they are allocated (and page-faulted) once
    instead of as large as the gradient, and there are few enough blocks that Python's
    per-op overhead stays small; a block is large enough for its ops to run on every
    intra-op thread (BLOCK-sized blocks kept each op on one thread: slower on a machine
    whose threads are free, ``benchmarks/compress_throughput.py`` measures it).
    CUDA: no cache to fit and a kernel launch per op per block, while the caching
    allocator reuses temporaries of any size: one block of the whole tensor.
    ``None`` means the CPU.
    """
    if device is not None and torch.device(device).type != "cpu":
        return ONE_PASS
    return 16 * BLOCK


#: a block size larger than any tensor (a multiple of 8, as blocks of packed codes must be)
ONE_PASS = 1 << 62


def cpu_fast(where: Tensor | torch.device) -> bool:
    """True where a tensor (or a device) may take a CPU-only fast path (numpy, decisions
    that read a tensor): it is the CPU and :data:`CPU_FAST_PATHS` is on."""
    device = where.device if isinstance(where, Tensor) else torch.device(where)
    return CPU_FAST_PATHS and device.type == "cpu"


if sys.byteorder != "little":  # the int64 <-> uint8 views below assume little-endian words
    raise ImportError("hexagram.compress.packing needs a little-endian machine")

# Moves bit 8i of a word (byte i's low bit) to bit 56 + i: the product sums
# b_i * 2**(8i + 56 - 7j); only i == j lands in bits 56..63 and no two terms collide.
_GATHER_LOW_BITS = 0x0102040810204080


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes taken by ``n`` codes of ``bits`` bits: ``ceil(n * bits / 8)``."""
    return (n * bits + 7) // 8


def blocks(n: int, block: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive blocks of ``block`` elements covering ``range(n)``."""
    for start in range(0, n, block):
        yield start, min(n, start + block)


def _steps(bits: int) -> list[tuple[int, int, int]]:
    """(shift, low mask, high mask) of the 3 steps that squeeze 8 byte-aligned fields of
    ``bits`` bits into the low ``8 * bits`` bits of an int64 word.

    Step k merges pairs of fields ``width = 8 * 2**k`` bits apart: in each lane of
    ``2 * width`` bits the high field moves down next to the low one. All masks stay below
    bit 63 (bits <= 7), so arithmetic shifts of the signed words never see a sign bit.
    """
    steps = []
    for width in (8, 16, 32):
        per = bits * (width // 8)  # bits in each field before this step
        lane = 2 * width
        low = sum(((1 << per) - 1) << (k * lane) for k in range(64 // lane))
        steps.append((width - per, low, low << per))
    return steps


#: int dtype of a word holding the ``8 // bits`` one-byte codes that pack into one byte
_WORD = {2: torch.int32, 4: torch.int16}


def _pack_words(codes: Tensor, bits: int, out: Tensor) -> Tensor:
    """Bits 2 and 4, ``n`` a multiple of ``8 // bits``: ``out`` := the packed bytes.

    In a little-endian word of ``8 // bits`` codes, code i sits at bit 8i; shifting the
    word right by ``(8 - bits) i`` brings it to bit ``bits * i`` and every other code
    either out of the word or above bit 7, so the low byte of the or of the shifted words
    is the packed byte: ``8 // bits - 1`` shifts and ors on ``n * bits / 8`` words.
    """
    w = codes.view(_WORD[bits])
    acc = w >> (8 - bits)
    for i in range(2, 8 // bits):
        acc |= w >> ((8 - bits) * i)
    acc |= w
    return out.copy_(acc)  # int -> uint8 keeps the low byte


def pack_codes(codes: Tensor, bits: int, out: Tensor | None = None) -> Tensor:
    """``codes`` (1-D uint8, each < ``2**bits``) packed into ``ceil(n * bits / 8)`` bytes.

    With ``out`` (uint8, that many bytes) the result is written there and returned.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    n = codes.numel()
    if bits in _WORD and codes.storage_offset() % (8 // bits):
        codes = codes.clone()  # a slice off a word boundary: the word view needs alignment
    if bits in _WORD and n % (8 // bits) == 0 and codes.is_contiguous():
        return _pack_words(codes, bits, out if out is not None
                           else codes.new_empty(packed_nbytes(n, bits)))
    if out is not None:
        return out.copy_(pack_codes(codes, bits))
    if bits == 8:
        return codes.clone()
    groups = -(-n // 8)
    if groups * 8 != n:  # pad to whole groups of 8 codes with zero codes
        codes = torch.cat([codes, codes.new_zeros(groups * 8 - n)])
    if bits in _WORD:  # padded to whole groups of 8 codes: whole words
        return pack_codes(codes, bits)[: packed_nbytes(n, bits)]
    w = codes.view(torch.int64)  # (groups,): byte i of a word = code i
    if bits == 1:
        packed = ((w * _GATHER_LOW_BITS) >> 56).to(torch.uint8)  # truncation keeps bits 56..63
        return packed[: packed_nbytes(n, 1)]
    w = w.clone()
    for shift, low, high in _steps(bits):
        kept = w & low
        w.bitwise_right_shift_(shift).bitwise_and_(high).bitwise_or_(kept)
    packed = w.view(torch.uint8).view(groups, 8)[:, :bits]  # the word's low `bits` bytes
    return packed.reshape(-1)[: packed_nbytes(n, bits)]


def _unpack_table(bits: int) -> Tensor:
    """(256,) words: entry b holds the ``8 // bits`` one-byte codes packed in byte b."""
    per = 8 // bits
    b = torch.arange(256, dtype=torch.int64).unsqueeze(1)
    codes = (b >> (bits * torch.arange(per))) & ((1 << bits) - 1)  # (256, per)
    word = (codes << (8 * torch.arange(per))).sum(1)  # code i in byte i (little-endian)
    dtype = {1: torch.int64, 2: torch.int32, 4: torch.int16}[bits]
    return word.view(torch.uint8).view(256, 8)[:, :per].contiguous().view(dtype).view(256)


#: lookup tables of :func:`unpack_codes` for 1, 2 and 4 bits: one index_select per call is
#: 3-6x faster than shifting and masking every code
_UNPACK = {bits: _unpack_table(bits) for bits in (1, 2, 4)}

#: (bits, device) -> :data:`_UNPACK`'s table on that device: copied host-to-device once,
#: not on every decode (a copy of host data waits for the device)
_UNPACK_ON: dict[tuple[int, str], Tensor] = {}


def unpack_table(bits: int, device: torch.device | str | None = None) -> Tensor:
    """The (256,) word table of :func:`unpack_codes` for ``bits`` (1, 2 or 4) on ``device``
    (cached per device)."""
    if device is None or torch.device(device).type == "cpu":
        return _UNPACK[bits]
    key = (bits, str(torch.device(device)))
    table = _UNPACK_ON.get(key)
    if table is None:
        table = _UNPACK_ON[key] = _UNPACK[bits].to(device)
    return table


def byte_codes(bits: int, device: torch.device | str | None = None) -> Tensor:
    """(256, 8 // bits) uint8: the codes packed in each byte value (bits 1, 2 or 4), on
    ``device`` (cached per device; the CPU by default)."""
    return unpack_table(bits, device).view(torch.uint8).view(256, 8 // bits)


def unpack_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """The ``n`` uint8 codes that :func:`pack_codes` stored in ``packed``."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    if packed.numel() != packed_nbytes(n, bits):
        raise ValueError(f"{n} codes of {bits} bits take {packed_nbytes(n, bits)} bytes, "
                         f"got {packed.numel()}")
    if bits == 8:
        return packed.clone()
    if bits in _UNPACK:  # each byte -> the word of its 8 // bits codes, by table lookup
        table = unpack_table(bits, packed.device)
        return table.index_select(0, packed.int()).view(torch.uint8)[:n]
    groups = -(-n // 8)
    words = packed.new_zeros(groups, 8)  # each group's bytes, zero-extended to an int64
    flat = words[:, :bits]
    flat.copy_(_pad_to(packed, groups * bits).view(groups, bits))
    w = words.view(torch.int64).view(groups)
    for shift, low, high in reversed(_steps(bits)):
        kept = w & low
        w.bitwise_and_(high).bitwise_left_shift_(shift).bitwise_or_(kept)
    return words.view(-1)[:n]


def _pad_to(t: Tensor, size: int) -> Tensor:
    if t.numel() == size:
        return t
    return torch.cat([t, t.new_zeros(size - t.numel())])


def encode_blocks(n: int, bits: int, fill: Callable[[int, int, Tensor], None],
                  device: torch.device, block: int | None = None) -> Tensor:
    """Packed codes of ``n`` elements, computed block by block.

    ``fill(start, stop, codes)`` writes the uint8 codes of elements ``[start, stop)`` into
    ``codes`` (a reused buffer). ``block`` (default :func:`block_size`) must be a
    multiple of 8 so every block starts on a byte boundary of the packed output.
    """
    block = block_size(device) if block is None else block
    if block % 8:
        raise ValueError(f"block must be a multiple of 8, got {block}")
    out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=device)
    if bits == 8:  # codes are the bytes: fill the output directly
        for start, stop in blocks(n, block):
            fill(start, stop, out[start:stop])
        return out
    buf = torch.empty(min(block, n), dtype=torch.uint8, device=device)
    for start, stop in blocks(n, block):
        codes = buf[: stop - start]
        fill(start, stop, codes)
        first = start * bits // 8
        pack_codes(codes, bits, out=out[first : first + packed_nbytes(stop - start, bits)])
    return out


def decode_blocks(packed: Tensor, bits: int, n: int, use: Callable[[int, int, Tensor], None],
                  block: int | None = None) -> None:
    """Calls ``use(start, stop, codes)`` with the uint8 codes of each block of elements."""
    block = block_size(packed.device) if block is None else block
    if block % 8:
        raise ValueError(f"block must be a multiple of 8, got {block}")
    for start, stop in blocks(n, block):
        first = start * bits // 8
        part = packed[first : first + packed_nbytes(stop - start, bits)]
        use(start, stop, part if bits == 8 else unpack_codes(part, bits, stop - start))


def random_words(gen: torch.Generator, device: torch.device) -> Callable[[int], Tensor]:
    """``draw(k)``: ``k`` int64 words of random bits, all determined by ``gen``'s state.

    On the CPU the bits come from numpy's SFC64 seeded with one draw from ``gen``: twice as
    fast as ``gen``'s own mt19937 (13 vs 27 us per 31,744 16-bit dithers) and as good for
    dithering; each call advances ``gen`` by that one draw, so checkpoints of ``gen`` still
    resume exactly. Elsewhere (CUDA) ``gen`` draws the words itself.
    """
    if not cpu_fast(device):
        return lambda k: torch.empty(k, dtype=torch.int64, device=device).random_(
            -(2**63), None, generator=gen)
    seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=device))
    bits = np.random.SFC64(seed)
    return lambda k: torch.from_numpy(bits.random_raw(k).view(np.int64))
