"""A character-level text corpus that ships offline: Python's own documentation.

The text is CPython's ``pydoc_data.topics`` (the help() pages of the language reference,
about 465k characters of English prose and code, present in every CPython install). Characters
map to a fixed 96-symbol vocabulary (printable ASCII and newline; anything else becomes
``?``), so models built for it are the same everywhere.

Example:
    >>> corpus = load_text()
    >>> corpus.vocab_size, len(corpus.train) > 400_000
    (96, True)
    >>> corpus.decode(corpus.encode("hi\\n"))
    'hi\\n'
    >>> x, y = corpus.batch("train", batch=2, block=8, generator=None)
    >>> tuple(x.shape), bool((x[:, 1:] == y[:, :-1]).all())
    ((2, 8), True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["VOCAB", "TextCorpus", "load_text"]

#: newline then printable ASCII 32..126: 96 symbols; index of '?' stands for the rest.
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
_INDEX = {ch: i for i, ch in enumerate(VOCAB)}
_UNKNOWN = _INDEX["?"]


@dataclass(frozen=True)
class TextCorpus:
    """Encoded train/validation text (int64 token ids) and the vocabulary."""

    name: str
    train: Tensor
    valid: Tensor

    @property
    def vocab_size(self) -> int:
        return len(VOCAB)

    @staticmethod
    def encode(text: str) -> Tensor:
        """Characters -> int64 ids (unknown characters -> id of ``?``)."""
        return torch.tensor([_INDEX.get(ch, _UNKNOWN) for ch in text], dtype=torch.int64)

    @staticmethod
    def decode(ids: Tensor) -> str:
        """int64 ids -> characters."""
        return "".join(VOCAB[i] for i in ids.tolist())

    def batch(self, split: str, batch: int, block: int,
              generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        """Random windows: inputs (batch, block) and next-character targets (batch, block)."""
        data = self.train if split == "train" else self.valid
        if len(data) <= block + 1:
            raise ValueError(f"block={block} is longer than the {split} text ({len(data)})")
        starts = torch.randint(0, len(data) - block - 1, (batch,), generator=generator)
        offsets = torch.arange(block)
        x = data[starts[:, None] + offsets]  # (batch, block)
        y = data[starts[:, None] + offsets + 1]
        return x, y


def load_text(valid_fraction: float = 0.1) -> TextCorpus:
    """The Python documentation corpus; the last ``valid_fraction`` is validation text."""
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions strip it
        raise FileNotFoundError(
            "the offline text corpus needs CPython's pydoc_data package (part of the standard "
            "library; Debian ships it in libpython3.X-stdlib); reinstall Python's standard "
            "library or train on images instead") from exc
    text = "\n".join(topics[key] for key in sorted(topics))
    ids = TextCorpus.encode(text)
    cut = int(len(ids) * (1.0 - valid_fraction))
    return TextCorpus("pydoc-topics", ids[:cut], ids[cut:])
