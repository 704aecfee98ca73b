"""Triton's mode for the fused-kernel tests: the interpreter on a machine without CUDA.

The interpreter (``hexagram.compress.kernels.use_interpreter``) must be chosen before Triton
is imported, and stays the process's only mode. A test module calls :func:`select` at
import: it skips the module where Triton is not installed, and says whether the kernels
run in this process (CUDA, or the interpreter chosen in time); where they do not (Triton
was imported compiled by an earlier module), :func:`rerun_in_fresh_process` runs the module
in a process of its own.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

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
