"""GPT-2 (from a config, no download) on offline text with Lightning and HexagramStrategy.

    torchrun --nproc-per-node 2 examples/gpt2_lightning.py --algorithm local_sgd --config period=8
    torchrun --nproc-per-node 2 examples/gpt2_lightning.py --algorithm ddp   # DDPStrategy

``--accumulate N`` maps to ``Trainer(accumulate_grad_batches=N)``.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from hexagram.integrations.gpt2 import TextWindows, example_parser, parse_config, report, tiny_gpt2
from hexagram.integrations.lightning import HexagramStrategy


class LitGPT2(L.LightningModule):
    """The GPT-2 as a LightningModule; records rank-local loss per optimizer step."""

    def __init__(self, block: int, lr: float, accumulate: int) -> None:
        super().__init__()
        self.gpt = tiny_gpt2(seed=0, block=block)
        self.lr, self.accumulate = lr, accumulate
        self.micro: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
        loss = self.gpt(**batch).loss
        self.micro.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)

    def step_losses(self) -> list[float]:
        n = self.accumulate
        return [sum(self.micro[i:i + n]) / n for i in range(0, len(self.micro), n)]


def main() -> None:
    args = example_parser(__doc__.splitlines()[0]).parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = DDPStrategy() if args.algorithm == "ddp" else \
        HexagramStrategy(args.algorithm, **parse_config(args.config))
    lit = LitGPT2(args.block, args.lr, args.accumulate)
    trainer = L.Trainer(accelerator="auto", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        num_nodes=world // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        strategy=strategy, max_steps=args.steps,
                        accumulate_grad_batches=args.accumulate, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    n = args.steps * args.accumulate * args.batch * world
    trainer.fit(lit, DataLoader(TextWindows(n, block=args.block), batch_size=args.batch))
    sent = None if args.algorithm == "ddp" else strategy.bytes_sent  # type: ignore[attr-defined]
    report(args, "lightning", lit.step_losses(), sent)


if __name__ == "__main__":
    main()
