"""GPT-2 (from a config, no download) on offline text with Accelerate and Hexagram.

    torchrun --nproc-per-node 2 examples/gpt2_accelerate.py --algorithm powersgd --config rank=2
    torchrun --nproc-per-node 2 examples/gpt2_accelerate.py --algorithm ddp  # accelerate's DDP

The recipe: Accelerate prepares the optimizer and data loader, Hexagram wraps the model
(``hexagram.integrations.accelerate.prepare``); the loop is Accelerate's usual one.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from hexagram.integrations.accelerate import prepare
from hexagram.integrations.gpt2 import TextWindows, example_parser, parse_config, report, tiny_gpt2


def main() -> None:
    args = example_parser(__doc__.splitlines()[0]).parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),  # a GPU where there is one
                              gradient_accumulation_steps=args.accumulate)
    net = tiny_gpt2(seed=0, block=args.block)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    loader = DataLoader(TextWindows(args.steps * args.accumulate * args.batch * world,
                                    block=args.block), batch_size=args.batch)
    if args.algorithm == "ddp":
        model, opt, loader = accelerator.prepare(net, opt, loader)
    else:
        model, opt, loader = prepare(accelerator, net, opt, loader, algorithm=args.algorithm,
                                     **parse_config(args.config))
    losses, total = [], 0.0
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        total += float(loss.detach()) / args.accumulate
        if accelerator.sync_gradients:
            losses.append(total)
            total = 0.0
    sent = None
    if args.algorithm != "ddp":
        model.synchronize()
        sent = model.bytes_sent()
        model.close()
    assert accelerator.unwrap_model(model) is net
    report(args, "accelerate", losses, sent)


if __name__ == "__main__":
    main()
