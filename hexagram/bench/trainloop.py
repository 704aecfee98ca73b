"""Time-to-accuracy training on one rank (run by :mod:`hexagram.bench.worker`).

Images (Fashion-MNIST, digits): each rank trains on its interleaved shard, reshuffled every
epoch; test accuracy of every rank's own model is averaged over ranks (for decentralized and
delayed algorithms the replicas differ). Text: a small GPT on :mod:`hexagram.data.text`, an
"epoch" being as many characters as the training text holds; the metric is validation loss.

Evaluation happens ``evals_per_epoch`` times an epoch and is not counted in the training
clock; training stops at ``target`` (accuracy >=, or loss <=), after ``epochs``, or when the
clock passes ``time_limit`` — decided together so every rank runs the same steps (the
step, its clock, faults and that decision are :mod:`hexagram.bench.loop`'s).

Example (on every rank of a process group, as the worker runs it):
    >>> spec = {"dataset": "digits", "model": {"name": "mlp", "params": 60000, "layers": 2},
    ...         "algorithm": "allreduce", "lr": 0.1, "batch": 16, "epochs": 3,
    ...         "evals_per_epoch": 1, "time_limit": 600, "target": 0.9}
    >>> sorted(run_training(spec))                           # doctest: +SKIP
    ['bytes_sent', 'curve', 'metric', 'num_params', 'reached', 'steps']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from hexagram.bench.loop import Loop, Progress, run_epochs, train_step

__all__ = ["run_training"]

Batches = Callable[[int], list[tuple[Tensor, Tensor]]]


def _image_task(spec: dict[str, Any]) -> tuple[nn.Module, Batches, Callable[[nn.Module], float]]:
    from hexagram.data import load, shard
    from hexagram.models import cnn, hidden_for_params, mlp

    data = load(spec["dataset"])
    side = data.x_train.shape[-1]
    m = spec["model"]
    torch.manual_seed(spec.get("seed", 0))
    if m["name"] == "cnn":
        model: nn.Module = cnn(side, channels=16, hidden=m["width"], classes=data.classes)
    else:
        hidden = hidden_for_params(m["params"], side * side, m["layers"], data.classes)
        model = mlp(side * side, hidden, m["layers"], data.classes)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = shard(data.x_train, data.y_train, rank, world)
    if spec.get("byzantine") or spec.get("partition", "iid") != "iid":  # robustness runs
        from hexagram.bench.robust import training_shard

        x, y = training_shard(spec, data.x_train, data.y_train, data.classes, rank, world)
    batch = spec["batch"]

    def epoch_batches(epoch: int) -> list[tuple[Tensor, Tensor]]:
        g = torch.Generator().manual_seed(spec.get("seed", 0) * 1000 + epoch * 97 + rank)
        perm = torch.randperm(len(y), generator=g)
        return [(x[perm[i:i + batch]], y[perm[i:i + batch]])
                for i in range(0, len(y) - batch + 1, batch)]

    @torch.no_grad()
    def accuracy(net: nn.Module) -> float:
        net.eval()
        correct = sum(int((net(xb).argmax(1) == yb).sum()) for xb, yb in
                      zip(data.x_test.split(2000), data.y_test.split(2000)))
        net.train()
        return correct / len(data.y_test)

    return model, epoch_batches, accuracy


def _text_task(spec: dict[str, Any]) -> tuple[nn.Module, Batches, Callable[[nn.Module], float]]:
    from hexagram.data import load_text
    from hexagram.models import GPT, GPTConfig

    corpus = load_text()
    m = spec["model"]
    cfg = GPTConfig(vocab_size=corpus.vocab_size, block_size=m["block"], n_layer=m["layers"],
                    n_head=max(1, m["width"] // 64), n_embd=m["width"])
    torch.manual_seed(spec.get("seed", 0))
    model = GPT(cfg)
    rank, world, batch = dist.get_rank(), dist.get_world_size(), spec["batch"]
    per_epoch = max(1, len(corpus.train) // (m["block"] * batch * world))
    valid_gen = torch.Generator().manual_seed(12345)
    valid = [corpus.batch("valid", 32, m["block"], valid_gen) for _ in range(8)]

    def epoch_batches(epoch: int) -> list[tuple[Tensor, Tensor]]:
        g = torch.Generator().manual_seed(spec.get("seed", 0) * 1000 + epoch * 97 + rank)
        return [corpus.batch("train", batch, m["block"], g) for _ in range(per_epoch)]

    @torch.no_grad()
    def valid_loss(net: nn.Module) -> float:
        net.eval()
        losses = [float(_lm_loss(net(xb), yb)) for xb, yb in valid]
        net.train()
        return sum(losses) / len(losses)

    return model, epoch_batches, valid_loss


def _lm_loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def run_training(spec: dict[str, Any]) -> dict[str, Any]:
    """Train until target / epochs / time limit (``spec``: the worker's train spec, see
    the module doc); return this rank's curve, the point that reached the target (or None),
    the steps run, the bytes it sent, the metric's name and the model's size."""
    from hexagram.bench.peers import make_optimizer, wrap
    from hexagram.testing.faults import FaultInjector, parse_faults

    text = spec["dataset"] == "text"
    model, epoch_batches, evaluate = (_text_task if text else _image_task)(spec)
    loss_fn = _lm_loss if text else F.cross_entropy
    opt = make_optimizer(spec["algorithm"], model.parameters(), spec["lr"], adaptive=text,
                         warmup=spec.get("optimizer_warmup", 50))
    if spec.get("byzantine"):  # the last ranks attack (hexagram.bench.robust)
        from hexagram.bench.robust import attacked_wrap

        wrapped = attacked_wrap(spec, model, opt, dist.get_world_size())
    else:
        wrapped = wrap(spec["algorithm"], model, opt, spec.get("config") or {},
                       bucket_mb=spec.get("bucket_mb"))
    target = spec.get("target")
    reached_by = None if target is None else (
        (lambda v: v <= target) if text else (lambda v: v >= target))
    loop = Loop(step=train_step(wrapped.model, opt, loss_fn, wrapped.after_step),
                faults=FaultInjector(parse_faults(spec.get("faults") or ""), dist.get_rank()))
    progress = Progress(evaluate=lambda: evaluate(model), reached_by=reached_by,
                        time_limit=spec["time_limit"])
    run_epochs(loop, progress, epoch_batches, epochs=spec["epochs"],
               evals_per_epoch=spec["evals_per_epoch"])
    sent = wrapped.bytes_sent()
    wrapped.close()
    return {"curve": progress.curve, "reached": progress.reached, "steps": loop.steps,
            "bytes_sent": sent, "metric": "valid_loss" if text else "test_accuracy",
            "num_params": sum(p.numel() for p in model.parameters())}
