"""Fault and attack injection shared by tests and benchmarks."""
