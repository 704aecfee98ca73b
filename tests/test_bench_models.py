"""Benchmark models and the offline text corpus."""

from __future__ import annotations

import pytest
import torch

from hexagram.data.text import VOCAB, load_text
from hexagram.errors import ConfigError
from hexagram.models import GPT, GPTConfig, cnn, gpt_params
from hexagram.models.workload import ModelSpec, build_workload


def test_gpt_is_causal_and_counts_its_parameters() -> None:
    cfg = GPTConfig(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg).eval()
    assert gpt_params(cfg) == sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 20, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 20  # change only the future of position 9
    a, b = model(x), model(y)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    with pytest.raises(ConfigError, match="n_head"):
        GPTConfig(n_head=3, n_embd=32)


def test_gpt_learns_the_text() -> None:
    torch.manual_seed(0)
    corpus = load_text()
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=32, n_layer=1, n_head=2,
                          n_embd=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        x, y = corpus.batch("train", 16, 32, gen)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 96), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 4.0  # about ln(96) = 4.56 at the start
    assert sum(losses[-10:]) / 10 < 3.2  # character frequencies and bigrams learned


def test_text_corpus_is_fixed_and_round_trips() -> None:
    corpus = load_text()
    assert len(VOCAB) == corpus.vocab_size == 96
    assert corpus.train.max() < 96 and corpus.train.min() >= 0
    assert len(corpus.valid) > 40_000
    sample = "def f(x):\n    return x  # ok?"
    assert corpus.decode(corpus.encode(sample)) == sample
    assert corpus.decode(corpus.encode("é")) == "?"


def test_cnn_and_workloads_shapes() -> None:
    assert cnn(8, channels=4, hidden=16)(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    with pytest.raises(ValueError, match="multiple of 4"):
        cnn(10)
    for name in ("mlp", "cnn", "gpt"):
        work = build_workload(ModelSpec(name=name, params=50_000, width=64, layers=1,
                                        block=8), seed=1)
        x, y = work.batch(4, torch.Generator().manual_seed(0))
        assert work.loss(work.model(x), y).isfinite()
    a = build_workload(ModelSpec(params=50_000), seed=3).model
    b = build_workload(ModelSpec(params=50_000), seed=3).model
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
