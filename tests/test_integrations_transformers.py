"""HexagramTrainer with the real transformers Trainer: 2 ranks on CPU (gloo), GPT-2 from a
config trained on offline text.

One spawned job: allreduce vs the Trainer's own DDP (identical losses and weights, with
gradient accumulation); powersgd and local_sgd train and ``save_model`` writes the consensus
model; accumulation sends no extra bytes. Single process: the wrapper exposes the model's
forward signature, so a Trainer given the wrapper keeps the dataset's columns.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # spawns 2 ranks that import transformers (~10 s each)

pytest.importorskip("transformers", reason="needs the 'integrations' extra (transformers)")
pytest.importorskip("accelerate", reason="needs the 'integrations' extra (accelerate)")

from hexagram.launch import run_local  # noqa: E402

STEPS = 3


def _train(base: type, out_dir: str, accumulate: int, save_steps: int = 0,
           resume: str | None = None, **kwargs: Any) -> dict[str, Any]:
    from transformers import TrainingArguments

    from hexagram.integrations.gpt2 import TextWindows, tiny_gpt2

    class Recording(base):  # type: ignore[misc, valid-type]
        losses: list[float]

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kw)
            self.losses.append(float(loss.detach()))
            return loss

    args = TrainingArguments(out_dir, use_cpu=True, per_device_train_batch_size=2,
                             gradient_accumulation_steps=accumulate, max_steps=STEPS,
                             learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
                             save_strategy="steps" if save_steps else "no",
                             save_steps=save_steps or 500, report_to=[], disable_tqdm=True,
                             logging_strategy="no", seed=0, dataloader_num_workers=0)
    net = tiny_gpt2(seed=0, n_embd=32)
    trainer = Recording(model=net, args=args, train_dataset=TextWindows(64, block=32),
                        **kwargs)
    trainer.losses = []
    trainer.train(resume_from_checkpoint=resume)
    out = {"losses": list(trainer.losses),
           "weights": torch.cat([p.detach().flatten() for p in net.parameters()]),
           "bytes": getattr(trainer, "hexagram_bytes_sent", 0)}
    if kwargs and not save_steps and resume is None:
        trainer.save_model(out_dir)
    return out


def _worker(tmp: str) -> dict[str, Any]:
    from transformers import Trainer

    from hexagram.integrations.transformers import HexagramTrainer

    out = {"ddp": _train(Trainer, os.path.join(tmp, "ddp"), 3),
           "allreduce": _train(HexagramTrainer, os.path.join(tmp, "ar"), 3,
                               algorithm="allreduce"),
           "no_accumulation": _train(HexagramTrainer, os.path.join(tmp, "ar1"), 1,
                                     algorithm="allreduce"),
           "powersgd": _train(HexagramTrainer, os.path.join(tmp, "psgd"), 3,
                              algorithm="powersgd", hexagram_config={"rank": 2}),
           "local_sgd": _train(HexagramTrainer, os.path.join(tmp, "lsgd"), 3,
                               algorithm="local_sgd", hexagram_config={"period": 2})}
    resumable = {"algorithm": "powersgd", "hexagram_config": {"rank": 2, "start_iter": 0}}
    ckpt_dir = os.path.join(tmp, "resume")
    out["uninterrupted"] = _train(HexagramTrainer, ckpt_dir, 3, save_steps=2, **resumable)
    torch.distributed.barrier()
    checkpoint = os.path.join(ckpt_dir, "checkpoint-2")
    out["checkpoint_files"] = sorted(f for f in os.listdir(checkpoint) if "hexagram" in f)
    out["resumed"] = _train(HexagramTrainer, ckpt_dir, 3, resume=checkpoint, **resumable)
    torch.distributed.barrier()
    from transformers import GPT2LMHeadModel

    saved = GPT2LMHeadModel.from_pretrained(os.path.join(tmp, "lsgd"))
    out["saved_local_sgd"] = torch.cat([p.detach().flatten() for p in saved.parameters()])
    import hexagram as hx

    wrapped = hx.DistributedDataParallel(saved)
    out["signature"] = (list(inspect.signature(wrapped.forward).parameters),
                        list(inspect.signature(saved.forward).parameters))
    wrapped.close()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        return run_local(_worker, world_size=2, args=(tmp,), timeout=240)


def test_allreduce_matches_trainer_ddp_with_accumulation(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert len(r["ddp"]["losses"]) == 3 * STEPS
        assert r["allreduce"]["losses"] == r["ddp"]["losses"]
        assert torch.equal(r["allreduce"]["weights"], r["ddp"]["weights"])


@pytest.mark.parametrize("name", ["powersgd", "local_sgd"])
def test_algorithms_train_and_end_in_consensus(results: list[dict[str, Any]],
                                               name: str) -> None:
    a, b = results[0][name], results[1][name]
    assert a["bytes"] > 0 and all(torch.isfinite(torch.tensor(a["losses"])))
    assert torch.equal(a["weights"], b["weights"])


def test_save_model_writes_the_consensus_model(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert torch.equal(r["saved_local_sgd"], results[0]["local_sgd"]["weights"])


def test_accumulation_sends_no_extra_bytes(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["allreduce"]["bytes"] == r["no_accumulation"]["bytes"] > 0


def test_wrapper_exposes_the_models_forward_signature(results: list[dict[str, Any]]) -> None:
    for r in results:  # what the Trainer reads to choose dataset columns
        assert r["signature"][0] == r["signature"][1]
        assert {"input_ids", "labels"} <= set(r["signature"][0])


def test_resumed_run_equals_an_uninterrupted_one(results: list[dict[str, Any]]) -> None:
    for r in results:  # PowerSGD's Q and error-feedback residuals came back, per rank
        assert r["checkpoint_files"] == ["hexagram_state_0.pt", "hexagram_state_1.pt"]
        full, resumed = r["uninterrupted"], r["resumed"]
        assert len(resumed["losses"]) == 3  # step 3 of 3: three micro-batches
        assert resumed["losses"] == full["losses"][-3:]
        assert torch.equal(resumed["weights"], full["weights"])
