"""Benchmark models and their synthetic batches: the same model for every algorithm of a run.

Example:
    >>> spec = ModelSpec(name="mlp", params=300_000)
    >>> work = build_workload(spec, seed=0)
    >>> x, y = work.batch(8, None)
    >>> work.loss(work.model(x), y).item() > 0, 250_000 < work.num_params < 350_000
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hexagram.config import check_choice, check_int
from hexagram.models import GPT, GPTConfig, cnn, hidden_for_params, mlp

__all__ = ["MODELS", "ModelSpec", "Workload", "build_workload"]

MODELS = ("mlp", "cnn", "gpt")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which model a run trains.

    Attributes:
        name: ``"mlp"`` (Fashion-MNIST-shaped input, hidden width chosen for ``params``),
            ``"cnn"`` (28x28 images) or ``"gpt"`` (96-symbol characters).
        params: target parameter count of the MLP; more => more bytes per step.
        layers: hidden layers of the MLP, or blocks of the GPT.
        width: CNN hidden width, or GPT embedding width.
        block: GPT context length.
    """

    name: str = "mlp"
    params: int = 6_300_000
    layers: int = 3
    width: int = 256
    block: int = 64

    def __post_init__(self) -> None:
        check_choice(self, "name", MODELS)
        check_int(self, "params", low=1000)
        check_int(self, "layers", low=1)
        check_int(self, "width", low=8)
        check_int(self, "block", low=2)


@dataclass
class Workload:
    """A model with a batch maker and a loss: ``loss(model(x), y)``."""

    model: nn.Module
    batch: Callable[[int, torch.Generator | None], tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor]

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def _classify(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits, y)


def _next_char(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def build_workload(spec: ModelSpec, seed: int = 0) -> Workload:
    """The model of ``spec`` (same weights for the same seed) and random batches of its
    input shape (step-time benchmarks need shapes, not meaning)."""
    torch.manual_seed(seed)
    if spec.name == "mlp":
        hidden = hidden_for_params(spec.params, 784, spec.layers, 10)
        model: nn.Module = mlp(784, hidden, spec.layers, 10)
        return Workload(model, lambda n, g: (torch.rand(n, 784, generator=g),
                                             torch.randint(0, 10, (n,), generator=g)), _classify)
    if spec.name == "cnn":
        model = cnn(28, channels=32, hidden=spec.width, classes=10)
        return Workload(model, lambda n, g: (torch.rand(n, 1, 28, 28, generator=g),
                                             torch.randint(0, 10, (n,), generator=g)), _classify)
    heads = max(1, spec.width // 64)
    cfg = GPTConfig(vocab_size=96, block_size=spec.block, n_layer=spec.layers, n_head=heads,
                    n_embd=spec.width)

    def tokens(n: int, g: torch.Generator | None) -> tuple[Tensor, Tensor]:
        ids = torch.randint(0, 96, (n, spec.block + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]

    return Workload(GPT(cfg), tokens, _next_char)
