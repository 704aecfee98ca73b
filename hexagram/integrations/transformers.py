"""``HexagramTrainer``: the Hugging Face ``Trainer`` with Hexagram's data parallelism.

Usage (``torchrun --nproc-per-node 2 train.py``)::

    from transformers import TrainingArguments
    from hexagram.integrations.transformers import HexagramTrainer

    args = TrainingArguments("out", use_cpu=True, gradient_accumulation_steps=4, ...)
    trainer = HexagramTrainer(model=gpt2, args=args, train_dataset=ds,
                              algorithm="powersgd", hexagram_config={"rank": 2})
    trainer.train()
    trainer.save_model()          # the consensus model (synchronize() ran at train end)

Pass the user's model as ``model=``. The Trainer wraps it with
``hexagram.DistributedDataParallel`` instead of PyTorch DDP (Accelerate still prepares the
optimizer and data loaders), attaches the optimizer it creates, skips communication in
accumulation micro-batches (``no_sync``), and at the end of training calls ``synchronize()``
(consensus weights for weight algorithms) and ``close()``, then unwraps.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import Trainer, TrainerCallback

from hexagram.engine.ddp import DistributedDataParallel
from hexagram.integrations import wrap
from hexagram.integrations.accelerate import install_unwrap

__all__ = ["HexagramTrainer"]


class _EndOfTraining(TrainerCallback):  # type: ignore[misc]
    """Consensus weights, then release the wrapper, when training ends (every rank)."""

    def __init__(self, trainer: HexagramTrainer) -> None:
        self.trainer = trainer

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._finish_hexagram()


class HexagramTrainer(Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` that trains with ``hexagram.DistributedDataParallel``.

    Args:
        *args, **kwargs: those of ``transformers.Trainer``.
        algorithm: a registered algorithm name or instance.
        hexagram_config: wrapper options (``bucket_size_mb``, ...) and algorithm fields
            (``{"rank": 2}`` for ``"powersgd"``, ``{"period": 8}`` for ``"local_sgd"``).

    After ``train()``, ``hexagram_bytes_sent`` holds this rank's algorithm bytes.
    """

    def __init__(self, *args: Any, algorithm: Any = "allreduce",
                 hexagram_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        install_unwrap()  # so the Trainer sees Hexagram's wrapper as a wrapper
        super().__init__(*args, **kwargs)
        self.hexagram_algorithm = algorithm
        self.hexagram_config = dict(hexagram_config or {})
        self.hexagram_bytes_sent = 0
        self.add_callback(_EndOfTraining(self))

    @property
    def hexagram_model(self) -> DistributedDataParallel | None:
        """The Hexagram wrapper during training (None otherwise)."""
        wrapped = self.model_wrapped
        return wrapped if isinstance(wrapped, DistributedDataParallel) else None

    def _wrap_model(self, model: nn.Module, training: bool = True,
                    dataloader: Any = None) -> nn.Module:
        if isinstance(model, DistributedDataParallel) or not training:
            return super()._wrap_model(model, training=training, dataloader=dataloader)
        return wrap(model, self.hexagram_algorithm, dict(self.hexagram_config))

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._prepare_for_training(*args, **kwargs)
        if self.hexagram_model is not None:  # the optimizer exists (Accelerate-wrapped) now
            self.hexagram_model.attach_optimizers(self.optimizer)
        return out

    def _finish_hexagram(self) -> None:
        wrapped = self.hexagram_model
        if wrapped is None:
            return
        wrapped.synchronize()  # save_model then writes the consensus model
        self.hexagram_bytes_sent = wrapped.bytes_sent()
        wrapped.close()
        self.model_wrapped = wrapped.module  # the user's model (self.model)
