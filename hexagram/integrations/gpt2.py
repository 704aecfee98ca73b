"""A small Hugging Face GPT-2 built from a config (no download) and offline text batches.

Shared by ``examples/``, the integration tests and ``benchmarks/integrations.py`` so that
every framework trains the same model on the same data: characters of Python's own
documentation (:mod:`hexagram.data.text`), 96-symbol vocabulary.

Example:
    >>> model = tiny_gpt2(seed=0)                                     # doctest: +SKIP
    >>> batches = text_batches(rank=0, world_size=2, steps=3)          # doctest: +SKIP
    >>> float(model(**batches[0]).loss) > 0                            # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hexagram.data.text import VOCAB, load_text

__all__ = ["TextWindows", "tiny_gpt2", "text_batches"]


def tiny_gpt2(seed: int = 0, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
              block: int = 64) -> Any:
    """``transformers.GPT2LMHeadModel`` from a config, dropout off (runs are deterministic).

    Bigger ``n_embd``/``n_layer`` => more compute and more bytes per step.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=len(VOCAB), n_positions=block, n_embd=n_embd,
                        n_layer=n_layer, n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def text_batches(rank: int, world_size: int, steps: int, batch: int = 4,
                 block: int = 64, seed: int = 0) -> list[dict[str, Tensor]]:
    """``steps`` batches ``{"input_ids", "labels"}`` (batch, block) for one rank.

    Rank ``r`` of ``world_size`` gets the same windows as a ``DistributedSampler`` would
    give it from one shared sequence of windows, so any framework sees the same data.
    """
    corpus = load_text()
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(corpus.train) - block - 1, (steps * world_size, batch),
                           generator=gen)
    out = []
    for step in range(steps):
        idx = starts[step * world_size + rank]
        ids = torch.stack([corpus.train[int(s):int(s) + block] for s in idx])
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


class TextWindows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Map-style dataset of single windows ``{"input_ids", "labels"}`` (block,) for the
    frameworks' own data loaders and samplers (Lightning, Accelerate, Trainer)."""

    def __init__(self, n: int, block: int = 64, seed: int = 0) -> None:
        corpus = load_text()
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(corpus.train) - block - 1, (n,), generator=gen)
        self.ids = torch.stack([corpus.train[int(s):int(s) + block] for s in starts])

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}
