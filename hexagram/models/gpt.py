"""A small GPT (decoder-only transformer) for character- or token-level language modelling.

The layout follows nanoGPT: token and position embeddings, ``n_layer`` pre-norm blocks of
causal self-attention (one fused ``qkv`` Linear, one ``proj`` Linear) and an MLP (``fc``,
``proj``), a final LayerNorm and an untied ``head``. Plain ``nn.Linear`` layers everywhere, so
planners can shard them and data-parallel engines see ordinary parameters.

Example:
    >>> import torch
    >>> cfg = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=64)
    >>> model = GPT(cfg)
    >>> logits = model(torch.zeros(3, 32, dtype=torch.long))
    >>> tuple(logits.shape)
    (3, 32, 96)
    >>> gpt_params(cfg) == sum(p.numel() for p in model.parameters())
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hexagram.errors import ConfigError

__all__ = ["GPT", "Block", "CausalSelfAttention", "GPTConfig", "gpt_params"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Attributes:
        vocab_size: number of tokens (96 for :mod:`hexagram.data.text`).
        block_size: longest context; larger => more position parameters and attention cost.
        n_layer: transformer blocks; more => more parameters and compute, linearly.
        n_head: attention heads; must divide ``n_embd``.
        n_embd: width; parameters grow with its square.
        dropout: dropout probability in training (0 keeps runs deterministic).
    """

    vocab_size: int = 96
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPTConfig.{name} must be an integer >= 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"GPTConfig.n_head={self.n_head} must divide "
                              f"n_embd={self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape  # (batch, time, n_embd)
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, n_head, t, c / n_head)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer: (batch, time) token ids -> (batch, time, vocab) logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialisation: small normal weights, zero biases.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def gpt_params(cfg: GPTConfig) -> int:
    """Number of parameters of ``GPT(cfg)`` without building it."""
    e, v = cfg.n_embd, cfg.vocab_size
    block = (e * 3 * e + 3 * e) + (e * e + e) + (e * 4 * e + 4 * e) + (4 * e * e + e) + 4 * e
    return v * e + cfg.block_size * e + cfg.n_layer * block + 2 * e + e * v
