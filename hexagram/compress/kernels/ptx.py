"""Compile the fused kernels for an NVIDIA GPU without one, and audit their PTX.

The kernels equal the eager code bit for bit only if every op rounds as torch's does: no
fused multiply-add (``fma``), exact divisions (``div.rn``, never the approximate
``div.full`` / ``div.approx`` that ``/`` on float32 becomes), no flushing of subnormals
(``.ftz``). Triton's interpreter cannot show that; this compiles one specialization of
every kernel to PTX (Triton's own compiler and bundled ``ptxas``, no GPU needed) and counts
those instructions. Run it in a process where Triton is not in interpreter mode.

Example:
    >>> report = audit()  # doctest: +SKIP
    >>> report["minmax_header"]  # doctest: +SKIP
    {'fma': 0, 'div.full': 0, 'div.approx': 0, 'ftz': 0, 'div.rn': 6}
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["PATTERNS", "audit"]

#: instruction patterns counted in each kernel's PTX
PATTERNS = {"fma": r"\bfma\.", "div.full": r"\bdiv\.full\.", "div.approx": r"\bdiv\.approx\.",
            "ftz": r"\.ftz\b", "div.rn": r"\bdiv\.rn\."}


def _specs() -> dict[str, tuple[Any, dict[str, str], dict[str, Any]]]:
    """name -> (kernel, signature, constexprs) of one float32 specialization each."""
    from hexagram.compress.kernels import triton_decode, triton_finite, triton_quant, triton_signs

    f32, u8 = "*fp32", "*u8"
    ints = {"n": "i32", "nbytes": "i32", "chunk": "i32"}
    return {
        "minmax_header": (triton_quant._minmax_header_kernel,
                          {"x_ptr": f32, "header_ptr": f32, "aux_ptr": f32, "n": "i32",
                           "chunk": "i32", "groups": "i32"},
                          {"HALF_TOP": 127.5, "RECIP": False, "ROWS": 2, "COLS": 1024}),
        "minmax_codes": (triton_quant._minmax_codes_kernel,
                         {"x_ptr": f32, "aux_ptr": f32, "out_ptr": u8, **ints},
                         {"BITS": 4, "STORE": 4, "GROUPS": 256}),
        "stochastic": (triton_quant._stochastic_kernel,
                       {"x_ptr": f32, "scale_ptr": f32, "pre_ptr": f32, "dither_ptr": "*i16",
                        "out_ptr": u8, **ints},
                       {"LEVELS": 3, "SHIFT": 3.5 + 2.0**-17, "HAS_PRE": True, "BITS": 3,
                        "GROUPS": 256}),
        "signs": (triton_signs._signs_kernel, {"x_ptr": f32, "out_ptr": u8, "n": "i32",
                                               "nbytes": "i32"}, {"GROUPS": 256}),
        "table": (triton_decode._table_kernel,
                  {"packed_ptr": u8, "values_ptr": f32, "scale_ptr": f32, "out_ptr": f32,
                   **ints},
                  {"BITS": 2, "HAS_SCALE": True, "ADD": True, "HALF": False, "BLOCK": 2048}),
        "affine": (triton_decode._affine_kernel,
                   {"packed_ptr": u8, "scale_ptr": f32, "offset_ptr": f32, "post_ptr": f32,
                    "out_ptr": "*fp16", **ints},
                   {"BITS": 3, "HAS_OFFSET": True, "HAS_POST": True, "ADD": True, "HALF": True,
                    "BLOCK": 2048}),
        "finite": (triton_finite._finite_kernel,
                   {"x_ptr": f32, "starts_ptr": "*i64", "bad_ptr": "*i8", "n": "i32",
                    "segments": "i32"}, {"LOG": 9, "BLOCK": 2048}),
    }


def audit(capability: int = 90) -> dict[str, dict[str, int]]:
    """Per kernel, the count of each :data:`PATTERNS` instruction in its PTX for compute
    capability ``capability`` (90: H100/H200), compiled as the kernels launch (no FP
    fusion). Raises whatever Triton raises if a kernel does not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hexagram.compress.kernels.triton_bits import FP_OPTIONS

    target = GPUTarget("cuda", capability, 32)
    report = {}
    for name, (fn, signature, constants) in _specs().items():
        sig = {**signature, **dict.fromkeys(constants, "constexpr")}
        compiled = triton.compile(ASTSource(fn, sig, constants), target=target,
                                  options=dict(FP_OPTIONS))
        ptx = compiled.asm["ptx"]
        report[name] = {key: len(re.findall(pat, ptx)) for key, pat in PATTERNS.items()}
    return report
