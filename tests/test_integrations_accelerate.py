"""Hexagram with the real Accelerate: 2 ranks on CPU (gloo), a GPT-2 from a config.

One spawned job: allreduce through :func:`hexagram.integrations.accelerate.prepare` vs
Accelerate's own DDP (``accelerator.prepare(model)``): identical losses and weights with
gradient accumulation; powersgd and local_sgd train (consensus after ``synchronize()``);
accumulation sends no extra bytes; ``unwrap_model`` returns the user's model; a Hexagram
model given to ``accelerator.prepare`` is refused with a clear error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # spawns 2 ranks that import transformers (~10 s each)

pytest.importorskip("accelerate", reason="needs the 'integrations' extra (accelerate)")
pytest.importorskip("transformers", reason="needs the 'integrations' extra (transformers)")

from hexagram.launch import run_local  # noqa: E402

STEPS = 4  # optimizer steps per run


def _train(accelerator: Any, algorithm: str | None, **config: Any) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    from hexagram.integrations.accelerate import prepare
    from hexagram.integrations.gpt2 import TextWindows, tiny_gpt2

    accum = accelerator.gradient_accumulation_steps
    net = tiny_gpt2(seed=0, n_embd=32)
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    loader = DataLoader(TextWindows(2 * 2 * accum * STEPS, block=32), batch_size=2)
    if algorithm is None:  # Accelerate's own PyTorch DDP
        model, opt, loader = accelerator.prepare(net, opt, loader)
    else:
        model, opt, loader = prepare(accelerator, net, opt, loader, algorithm=algorithm,
                                     **config)
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
    out: dict[str, Any] = {"losses": losses}
    if algorithm is not None:
        model.synchronize()
        out["bytes"] = model.bytes_sent()
        out["unwrapped_is_net"] = accelerator.unwrap_model(model) is net
        model.close()
    out["weights"] = torch.cat([p.detach().flatten() for p in net.parameters()])
    return out


def _worker() -> dict[str, Any]:
    import accelerate.utils
    from accelerate import Accelerator

    import hexagram as hx
    from hexagram.errors import ConfigError
    from hexagram.integrations.gpt2 import tiny_gpt2

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    out = {"ddp": _train(accelerator, None), "allreduce": _train(accelerator, "allreduce"),
           "powersgd": _train(accelerator, "powersgd", rank=2),
           "local_sgd": _train(accelerator, "local_sgd", period=2)}
    accelerator.gradient_accumulation_steps = 1
    out["no_accumulation"] = _train(accelerator, "allreduce")
    net = tiny_gpt2(seed=0, n_embd=32)
    wrapped = hx.DistributedDataParallel(net)
    out["extract_is_net"] = accelerate.utils.extract_model_from_parallel(wrapped) is net
    try:
        accelerator.prepare(wrapped)
        out["prepare_error"] = ""
    except ConfigError as e:
        out["prepare_error"] = str(e)
    wrapped.close()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local(_worker, world_size=2, timeout=240)


def test_allreduce_matches_accelerate_ddp_with_accumulation(
        results: list[dict[str, Any]]) -> None:
    for r in results:
        assert len(r["ddp"]["losses"]) == 3 * STEPS
        assert r["allreduce"]["losses"] == r["ddp"]["losses"]
        assert torch.equal(r["allreduce"]["weights"], r["ddp"]["weights"])


@pytest.mark.parametrize("name", ["powersgd", "local_sgd"])
def test_compressed_and_weight_algorithms_reach_consensus(
        results: list[dict[str, Any]], name: str) -> None:
    a, b = results[0][name], results[1][name]
    assert a["bytes"] > 0
    assert a["losses"][-1] < a["losses"][0]
    assert torch.equal(a["weights"], b["weights"])


def test_accumulation_sends_no_extra_bytes(results: list[dict[str, Any]]) -> None:
    for r in results:  # STEPS optimizer steps both; 3 micro-batches a step with accumulation
        assert r["allreduce"]["bytes"] == r["no_accumulation"]["bytes"] > 0


def test_unwrap_model_returns_the_users_model(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["allreduce"]["unwrapped_is_net"] and r["extract_is_net"]


def test_preparing_a_hexagram_model_is_refused(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert "already wrapped by hexagram.DistributedDataParallel" in r["prepare_error"]
        assert "prepare everything but the model" in r["prepare_error"]
