"""Shared pytest setup: the benchmark harnesses (``benchmarks/harness``) are importable."""

import sys
from pathlib import Path

_BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)
