"""Fault and attack injection shared by tests and benchmarks (:mod:`hexagram.testing.faults`,
:mod:`hexagram.testing.attacks`)."""

from hexagram.testing import faults as faults
