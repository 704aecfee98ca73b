"""Fault injection shared by tests and benchmarks (see :mod:`hexagram.testing.faults`)."""

from hexagram.testing import faults as faults
