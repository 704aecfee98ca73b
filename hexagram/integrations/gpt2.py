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

import argparse
import json
import os
from typing import Any

import torch
from torch import Tensor

from hexagram.data.text import VOCAB, load_text
from hexagram.errors import require

__all__ = ["TextWindows", "example_parser", "parse_config", "report", "text_batches",
           "tiny_gpt2"]


def tiny_gpt2(seed: int = 0, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
              block: int = 64) -> Any:
    """``transformers.GPT2LMHeadModel`` from a config, dropout off (runs are deterministic).

    Bigger ``n_embd``/``n_layer`` => more compute and more bytes per step.
    """
    transformers = require("transformers", extra="integrations", feature="tiny_gpt2")
    config = transformers.GPT2Config(vocab_size=len(VOCAB), n_positions=block, n_embd=n_embd,
                        n_layer=n_layer, n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


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


def example_parser(description: str) -> argparse.ArgumentParser:
    """Command line shared by ``examples/gpt2_*.py`` (and ``benchmarks/integrations.py``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--algorithm", default="allreduce",
                   help="a Hexagram algorithm (hexagram.algorithms.names()), or 'ddp' for "
                        "the framework's own PyTorch DDP")
    p.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="algorithm fields and wrapper options, e.g. rank=2 period=8")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch per rank")
    p.add_argument("--block", type=int, default=64, help="characters per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--json", default=None, help="rank 0 writes losses and bytes here")
    return p


def parse_config(items: list[str]) -> dict[str, Any]:
    """``["rank=2", "compressor=fp16"]`` -> ``{"rank": 2, "compressor": "fp16"}``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--config expects KEY=VALUE, got {item!r}")
        value: Any = raw
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
        out[key] = {"true": True, "false": False, "none": None}.get(raw.lower(), value)
    return out


def report(args: argparse.Namespace, framework: str, losses: list[float],
           bytes_sent: int | None) -> None:
    """Rank 0 prints the result line (and writes ``--json``): per-step losses of rank 0,
    algorithm bytes this rank sent per optimizer step (None for PyTorch DDP)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    per_step = None if bytes_sent is None else bytes_sent / max(args.steps, 1)
    sent = "n/a (PyTorch DDP)" if per_step is None else f"{per_step:,.0f}"
    print(f"{framework} {args.algorithm}: {len(losses)} steps, first loss {losses[0]:.4f}, "
          f"final loss {losses[-1]:.4f}, bytes/step {sent}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"framework": framework, "algorithm": args.algorithm,
                       "config": args.config, "losses": losses,
                       "bytes_per_step": per_step}, f)
