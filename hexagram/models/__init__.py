"""Reference models: MLPs of any size (and, from the benchmark work, a CNN and a small GPT)."""

from hexagram.models.cnn import cnn
from hexagram.models.gpt import GPT, GPTConfig, gpt_params
from hexagram.models.mlp import hidden_for_params, mlp

__all__ = ["GPT", "GPTConfig", "cnn", "gpt_params", "hidden_for_params", "mlp"]
