"""Layer-sequential models the planner can split into stages: an MLP stack and a GPT.

Both are ``nn.Sequential`` of layers, so a pipeline stage is a contiguous slice of children
and tensor parallelism can shard each ``nn.Linear`` by name. Build them on the ``"meta"``
device to plan 48 layers x hidden 1024+ without allocating weights.

The attention reshapes with ``-1`` heads, so it runs unchanged on a tensor-parallel shard
(``ColwiseParallel`` q/k/v hand it ``heads / tp`` heads).

Example:
    >>> m = gpt(layers=2, hidden=64, heads=4, vocab=100, device="meta")
    >>> len(m), type(m[1]).__name__
    (4, 'Block')
    >>> len(mlp_stack(layers=3, hidden=32, in_features=8, classes=4))
    5
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "Embed", "Head", "MLPBlock", "ResidualMLP", "gpt", "mlp_stack"]


class Embed(nn.Module):
    """Token + learned position embedding: ``[B, T]`` ints -> ``[B, T, H]``."""

    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class Attention(nn.Module):
    """Causal multi-head self-attention; heads inferred from the (possibly sharded) width."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        # [B, T, h*d] -> [B, h, T, d] with h = local heads (all heads, or heads / tp)
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class Head(nn.Module):
    """Final norm and vocabulary projection: ``[B, T, H]`` -> logits ``[B, T, V]``."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class MLPBlock(nn.Module):
    """``x + fc2(relu(fc1(x)))`` with a 4x inner width (a transformer MLP without attention)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def gpt(layers: int, hidden: int, heads: int, vocab: int = 50257, seq: int = 1024,
        device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """GPT-2-style model: ``Embed, Block x layers, Head`` (inputs ``[B, T]`` token ids)."""
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    with torch.device(device):
        mods: list[nn.Module] = [Embed(vocab, hidden, seq)]
        mods += [Block(hidden, heads) for _ in range(layers)]
        mods.append(Head(hidden, vocab))
        return nn.Sequential(*mods).to(dtype)


def mlp_stack(layers: int, hidden: int, in_features: int, classes: int,
              device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """``Linear(in, hidden), MLPBlock x layers, Linear(hidden, classes)`` on ``[B, in]``."""
    with torch.device(device):
        mods: list[nn.Module] = [nn.Linear(in_features, hidden)]
        mods += [MLPBlock(hidden) for _ in range(layers)]
        mods.append(nn.Linear(hidden, classes))
        return nn.Sequential(*mods).to(dtype)


class ResidualMLP(nn.Module):
    """A plain (not ``nn.Sequential``) model with residual connections, for the executor:
    ``h = relu(inp(x))``, ``h = h + fc2_i(relu(fc1_i(h)))`` per block, and a long skip from
    the first ``h`` to the output layer (it crosses every pipeline stage)."""

    def __init__(self, in_features: int, hidden: int, classes: int, blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, hidden)
        self.fc1 = nn.ModuleList(nn.Linear(hidden, 2 * hidden) for _ in range(blocks))
        self.fc2 = nn.ModuleList(nn.Linear(2 * hidden, hidden) for _ in range(blocks))
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        skip = h
        for up, down in zip(self.fc1, self.fc2):
            h = h + down(torch.relu(up(h)))
        return self.out(h + skip)  # type: ignore[no-any-return]
