"""Triton's mode for the fused-kernel tests: the interpreter on a machine without CUDA.

The interpreter (``hexagram.compress.kernels.use_interpreter``) must be chosen before Triton
is imported, and stays the process's only mode. A test module calls :func:`select` at
import: it skips the module where Triton is not installed, and says whether the kernels
run in this process (CUDA, or the interpreter chosen in time); where they do not (Triton
was imported compiled by an earlier module), :func:`rerun_in_fresh_process` runs the module
in a process of its own. :data:`DEVICES` and :func:`kernel_device` make a module's device
fixture; :func:`use_decoders` puts the kernels' decoders (or the eager ones) where the
compressors call them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

#: the repository (first on the path of the processes the tests start)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def select(what: str) -> bool:
    """Skip the calling module without Triton; True if its kernels run in this process."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip(f"triton is not installed (pip install -e '.[dev]'): {what} not tested",
                    allow_module_level=True)
    if torch.cuda.is_available():
        return True
    from hexagram.compress import kernels

    try:
        kernels.use_interpreter()
    except RuntimeError:  # triton imported compiled before: rerun_in_fresh_process
        return False
    return True


def rerun_in_fresh_process(path: str) -> None:
    """Run the test module at ``path`` in a process of its own, where the interpreter can
    be chosen first; fail with its output if it fails."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           path], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:]


#: the device fixtures' parameters: the interpreter on the CPU without CUDA, compiled kernels
#: on CUDA (the ``gpu`` tests)
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="CUDA is present: the kernels are compiled (the gpu tests)")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA (torch.cuda.is_available() is False)")]),
]


@contextmanager
def kernel_device(name: str, in_process: bool) -> Iterator[torch.device]:
    """The device under test (a :data:`DEVICES` value), with the eager code CUDA takes (no
    CPU fast paths) and the compressors' own dispatch to the kernels off (the tests call
    or patch in the kernels themselves); skips where the kernels do not run in this
    process (``in_process``: :func:`select`'s answer)."""
    from hexagram.compress import kernels, packing

    if not in_process:
        pytest.skip("triton was imported compiled before this module: see "
                    "test_in_a_fresh_process")
    packing.CPU_FAST_PATHS = False
    kernels.DISPATCH = False
    try:
        yield torch.device(name)
    finally:
        packing.CPU_FAST_PATHS = True
        kernels.DISPATCH = True


def use_decoders(patch: pytest.MonkeyPatch, fused: bool, calls: list[str] | None = None
                 ) -> None:
    """Every decoder the compressors call: the kernels' (``fused``; each call's kind,
    ``"table"`` or ``"affine"``, appended to ``calls``) or the eager ones."""
    from hexagram.compress import chunks, kernels, quantize, sign_blocks

    def counted(kind: str, kernel: Any) -> Any:
        def call(*args: Any, **kw: Any) -> torch.Tensor:
            if calls is not None:
                calls.append(kind)
            return kernel(*args, **kw)
        return call

    table, affine = (counted("table", kernels.decode_table),
                     counted("affine", kernels.decode_affine)) if fused else \
        (_EAGER["table"], _EAGER["affine"])
    for module in (chunks, quantize):
        patch.setattr(module, "decode_table", table)
    for module in (quantize, sign_blocks):
        patch.setattr(module, "decode_affine", affine)


def _eager() -> dict[str, Any]:
    from hexagram.compress import chunks

    return {"table": chunks.decode_table, "affine": chunks.decode_affine}


#: the eager decoders, as imported (before any test patches them in)
_EAGER = _eager()
