"""Shared pytest setup: the benchmark harnesses (``benchmarks/harness``) are importable;
the ``device_path`` fixture runs a test down the code CUDA takes, on the CPU."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)


@pytest.fixture
def device_path() -> Iterator[None]:
    """The CPU-only numpy fast paths off (``packing.CPU_FAST_PATHS``) for the test, so it
    runs the compressors' device code, as on CUDA."""
    from hexagram.compress import packing

    packing.CPU_FAST_PATHS = False
    try:
        yield
    finally:
        packing.CPU_FAST_PATHS = True
