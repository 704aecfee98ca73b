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

Checkpoints: every rank writes its algorithm state (PowerSGD's Q and error-feedback
residuals, counters, generators) as ``hexagram_state_<rank>.pt`` into each
``checkpoint-<step>`` folder the Trainer saves, and ``train(resume_from_checkpoint=...)``
loads it back, so a gradient algorithm resumes exactly where it stopped. Resume with the
same algorithm and world size. Weight algorithms (local SGD, ...) resume from the saved
model, rank 0's replica (save at a synchronization step for an exact resume).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from hexagram.errors import require

require("transformers", extra="integrations", feature="hexagram.integrations.transformers")

# ruff: noqa: E402  (the framework imports come after the one-line missing-extra check)
import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hexagram.engine.ddp import DistributedDataParallel
from hexagram.errors import ConfigError
from hexagram.integrations import wrap
from hexagram.integrations.accelerate import install_unwrap

__all__ = ["HexagramTrainer", "load_algorithm_state", "save_algorithm_state"]

#: per-rank algorithm state inside a Trainer checkpoint folder
STATE_FILE = "hexagram_state_{rank}.pt"


def save_algorithm_state(wrapped: DistributedDataParallel, folder: str) -> str:
    """Write this rank's algorithm state into checkpoint ``folder``; return the file path.

    Call on every rank (each writes its own file). Example:
    ``save_algorithm_state(model, "out/checkpoint-100")``.
    """
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE.format(rank=wrapped.comm.rank))
    torch.save({"algorithm": wrapped.algorithm.name, "world_size": wrapped.comm.size,
                "state": wrapped.algorithm_state_dict()}, path)
    return path


def load_algorithm_state(wrapped: DistributedDataParallel, folder: str) -> bool:
    """Restore this rank's state written by :func:`save_algorithm_state`.

    Returns False (with a warning: the algorithm starts afresh) when ``folder`` holds no
    Hexagram state; raises :class:`ConfigError` when it was saved by another algorithm or
    world size.
    """
    path = os.path.join(folder, STATE_FILE.format(rank=wrapped.comm.rank))
    if not os.path.exists(path):
        warnings.warn(f"{folder} holds no Hexagram algorithm state ({os.path.basename(path)})"
                      f": {wrapped.algorithm.name!r} starts with fresh state", stacklevel=2)
        return False
    saved = torch.load(path, weights_only=True)
    if saved["algorithm"] != wrapped.algorithm.name or saved["world_size"] != wrapped.comm.size:
        raise ConfigError(
            f"{path} holds {saved['algorithm']!r} state of {saved['world_size']} ranks; this "
            f"run uses {wrapped.algorithm.name!r} on {wrapped.comm.size} ranks: resume with the "
            f"same algorithm and world size, or delete the {STATE_FILE.format(rank='*')} files")
    wrapped.load_algorithm_state_dict(saved["state"])
    return True


class _EndOfTraining(TrainerCallback):  # type: ignore[misc]
    """Consensus weights, then release the wrapper, when training ends (every rank)."""

    def __init__(self, trainer: HexagramTrainer) -> None:
        self.trainer = trainer

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._finish_hexagram()


class HexagramTrainer(Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` that trains with ``hexagram.DistributedDataParallel``.

    Args:
        args, kwargs: the positional and keyword arguments of ``transformers.Trainer``.
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
        # the Trainer creates its optimizer after wrapping: _prepare_for_training attaches it
        return wrap(model, self.hexagram_algorithm, dict(self.hexagram_config),
                    optimizers="later")

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any,
                              resume_from_checkpoint: str | None) -> Any:
        out = super()._prepare_for_training(max_steps, train_dataloader,
                                            resume_from_checkpoint)
        wrapped = self.hexagram_model
        if wrapped is not None:  # the optimizer exists (Accelerate-wrapped) now
            wrapped.attach_optimizers(self.optimizer)
            if resume_from_checkpoint is not None:  # after set-up, which may reset state
                load_algorithm_state(wrapped, resume_from_checkpoint)
        return out

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        wrapped = self.hexagram_model
        if wrapped is not None:  # every rank: its own state next to the Trainer's files
            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            save_algorithm_state(wrapped, os.path.join(self._get_output_dir(trial=trial),
                                                       folder))

    def _finish_hexagram(self) -> None:
        wrapped = self.hexagram_model
        if wrapped is None:
            return
        wrapped.synchronize()  # save_model then writes the consensus model
        self.hexagram_bytes_sent = wrapped.bytes_sent()
        wrapped.close()
        self.model_wrapped = wrapped.module  # the user's model (self.model)
