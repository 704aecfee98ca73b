"""Optimizers that pair with communication algorithms (e.g. QAdam with ``algorithm="qadam"``)."""

from hexagram.optim.qadam import QAdamOptimizer

__all__ = ["QAdamOptimizer"]
