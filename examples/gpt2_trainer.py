"""GPT-2 (from a config, no download) on offline text with the Hugging Face Trainer.

    torchrun --nproc-per-node 2 examples/gpt2_trainer.py --algorithm local_sgd --config period=8
    torchrun --nproc-per-node 2 examples/gpt2_trainer.py --algorithm ddp    # Trainer's own DDP

``HexagramTrainer`` wraps the model with Hexagram; ``save_model`` after ``train()`` writes
the consensus model.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from hexagram.integrations.gpt2 import TextWindows, example_parser, parse_config, report, tiny_gpt2
from hexagram.integrations.transformers import HexagramTrainer


def _recording(base: type) -> Any:
    class Recording(base):  # type: ignore[misc, valid-type]
        """Records the loss of every micro-batch (the Trainer logs averages only)."""

        micro: list[float]

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.micro.append(float(loss.detach()))
            return loss

    return Recording


def main() -> None:
    args = example_parser(__doc__.splitlines()[0]).parse_args()
    out_dir = os.environ.get("HEXAGRAM_EXAMPLE_OUT") or tempfile.mkdtemp(prefix="gpt2_trainer")
    targs = TrainingArguments(out_dir, use_cpu=not torch.cuda.is_available(),
                              per_device_train_batch_size=args.batch,
                              gradient_accumulation_steps=args.accumulate,
                              max_steps=args.steps, learning_rate=args.lr,
                              optim="adamw_torch", weight_decay=0.0,
                              lr_scheduler_type="constant", save_strategy="no", report_to=[],
                              disable_tqdm=True, logging_strategy="no", seed=0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = TextWindows(args.steps * args.accumulate * args.batch * world, block=args.block)
    kwargs: dict[str, Any] = {} if args.algorithm == "ddp" else {
        "algorithm": args.algorithm, "hexagram_config": parse_config(args.config)}
    trainer = _recording(Trainer if args.algorithm == "ddp" else HexagramTrainer)(
        model=tiny_gpt2(seed=0, block=args.block), args=targs, train_dataset=data, **kwargs)
    trainer.micro = []
    trainer.train()
    trainer.save_model(out_dir)
    # Each micro-batch's loss is already normalised by the tokens of the whole optimizer
    # step (transformers' num_items_in_batch), so a step's loss is their sum.
    n = args.accumulate
    losses = [sum(trainer.micro[i:i + n]) for i in range(0, len(trainer.micro), n)]
    report(args, "trainer", losses, getattr(trainer, "hexagram_bytes_sent", None))


if __name__ == "__main__":
    main()
