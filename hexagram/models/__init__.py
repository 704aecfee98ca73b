"""Reference models: MLPs of any size (and, from the benchmark work, a CNN and a small GPT)."""

from hexagram.models.mlp import hidden_for_params, mlp

__all__ = ["hidden_for_params", "mlp"]
