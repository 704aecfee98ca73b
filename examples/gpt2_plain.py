"""GPT-2 (from a config, no download) on offline text with Hexagram in a plain PyTorch loop.

    torchrun --nproc-per-node 2 examples/gpt2_plain.py --algorithm powersgd --config rank=2
    torchrun --nproc-per-node 2 examples/gpt2_plain.py --algorithm ddp      # PyTorch DDP

Each rank trains on its own windows of Python's documentation; ``--accumulate N`` runs N
micro-batches per optimizer step, communicating only on the last (``no_sync``).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import hexagram as hx
from hexagram.integrations.gpt2 import example_parser, parse_config, report, text_batches, tiny_gpt2


def main() -> None:
    args = example_parser(__doc__.splitlines()[0]).parse_args()
    rt = hx.init()
    net = tiny_gpt2(seed=0, block=args.block).to(rt.device)  # the device hx.init() chose
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
    model: torch.nn.Module
    if args.algorithm == "ddp":
        model = TorchDDP(net)
    else:
        algorithm = hx.algorithms.get(args.algorithm, **parse_config(args.config))
        model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algorithm)
    batches = iter(text_batches(rt.rank, rt.world_size, args.steps * args.accumulate,
                                batch=args.batch, block=args.block))
    losses = []
    for _ in range(args.steps):
        total = 0.0
        for micro in range(args.accumulate):
            last = micro == args.accumulate - 1
            with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
                batch = {k: v.to(rt.device) for k, v in next(batches).items()}
                loss = model(**batch).loss / args.accumulate
                loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    sent = None
    if isinstance(model, hx.DistributedDataParallel):
        model.synchronize()  # consensus weights (weight algorithms); no-op for gradients
        sent = model.bytes_sent()
        model.close()
    report(args, "plain", losses, sent)


if __name__ == "__main__":
    main()
