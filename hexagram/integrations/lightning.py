"""``HexagramStrategy``: Lightning's DDP strategy with Hexagram's engine and algorithms.

Usage (``torchrun --nproc-per-node 2 train.py``, or ``Trainer(devices=2)`` which launches)::

    from lightning.pytorch import Trainer
    from hexagram.integrations.lightning import HexagramStrategy

    trainer = Trainer(accelerator="cpu", devices=2,
                      strategy=HexagramStrategy("powersgd", rank=2),
                      accumulate_grad_batches=4)
    trainer.fit(lit_module, loader)

What it does on top of Lightning's ``DDPStrategy``:

- wraps the LightningModule with ``hexagram.DistributedDataParallel`` (``algorithm`` and
  ``**config``: the wrapper's options such as ``bucket_size_mb`` and the algorithm's fields
  such as PowerSGD's ``rank``);
- attaches the optimizers Lightning creates after wrapping (weight algorithms count their
  steps), so local SGD, DiLoCo and decentralized training work;
- skips communication in ``accumulate_grad_batches`` micro-batches (``no_sync``);
- at the end of fitting calls ``synchronize()`` (consensus weights for weight algorithms),
  then ``close()`` and unwraps at teardown;
- saves every rank's algorithm state (residuals, warm starts, anchors) in Lightning
  checkpoints under ``"hexagram"`` and restores it on ``fit(ckpt_path=...)``.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any

from hexagram.errors import require

require("lightning", extra="integrations", feature="hexagram.integrations.lightning")

# ruff: noqa: E402  (the framework imports come after the one-line missing-extra check)
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from hexagram.engine.ddp import DistributedDataParallel
from hexagram.errors import ConfigError
from hexagram.integrations import wrap

__all__ = ["CHECKPOINT_KEY", "HexagramStrategy"]

#: key of the per-rank algorithm states in a Lightning checkpoint.
CHECKPOINT_KEY = "hexagram"


class HexagramStrategy(DDPStrategy):
    """Lightning strategy that trains with ``hexagram.DistributedDataParallel``.

    Args:
        algorithm: a registered algorithm name (``hexagram.algorithms.names()``) or an
            instance.
        **config: wrapper options (``bucket_size_mb``, ``first_bucket_mb``,
            ``find_unused_parameters``, ``broadcast_buffers``, ``gradient_as_bucket_view``)
            and the algorithm's config fields (e.g. ``rank=2`` for ``"powersgd"``).

    Lightning's own ``DDPStrategy`` arguments (``accelerator``, ``parallel_devices``,
    ``cluster_environment``, ``process_group_backend``, ``timeout``, ...) may be given by
    keyword under their usual names.
    """

    strategy_name = "hexagram"

    _LIGHTNING_ARGS = ("accelerator", "parallel_devices", "cluster_environment",
                       "checkpoint_io", "precision_plugin", "process_group_backend",
                       "timeout", "start_method")

    def __init__(self, algorithm: Any = "allreduce", **config: Any) -> None:
        lightning_kw = {k: config.pop(k) for k in self._LIGHTNING_ARGS if k in config}
        super().__init__(**lightning_kw)
        self.algorithm = algorithm
        self.hexagram_config = config
        self._pending_state: dict[str, Any] | None = None
        self.bytes_sent = 0  # this rank's algorithm bytes in the last fit (set at teardown)
        self._final: tuple[str, dict[str, Any]] | None = None  # state at the end of fit

    @property
    def hexagram_model(self) -> DistributedDataParallel | None:
        """The Hexagram wrapper while fitting (None before setup and after teardown)."""
        return self.model if isinstance(self.model, DistributedDataParallel) else None

    def _setup_model(self, model: nn.Module) -> Any:
        # Lightning creates the optimizers after wrapping: setup() attaches them
        return wrap(model, self.algorithm, dict(self.hexagram_config), optimizers="later")

    def configure_ddp(self) -> None:
        # PyTorch DDP's comm hooks do not apply: the algorithm does the communication.
        if self.model is None:
            raise ConfigError("HexagramStrategy: no model to wrap (call through Trainer.fit)")
        self.model = self._setup_model(self.model)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        wrapped = self.hexagram_model
        if wrapped is not None:
            wrapped.attach_optimizers(*self.optimizers)
            if self._pending_state is not None:
                self._load_algorithm_state(self._pending_state)
                self._pending_state = None

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        wrapped = self.hexagram_model
        if wrapped is None:
            yield None
            return
        with wrapped.no_sync():
            yield None

    def on_train_end(self) -> None:
        super().on_train_end()
        wrapped = self.hexagram_model
        if wrapped is not None:
            wrapped.synchronize()  # consensus weights before Lightning saves or evaluates

    def teardown(self) -> None:
        wrapped = self.hexagram_model
        if wrapped is not None:
            self.bytes_sent = wrapped.bytes_sent()
            self._final = (wrapped.algorithm.name, wrapped.algorithm_state_dict())
            wrapped.close()
            self.model = self.lightning_module
        super().teardown()

    # -- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        wrapped = self.hexagram_model
        current = (wrapped.algorithm.name, wrapped.algorithm_state_dict()) \
            if wrapped is not None else self._final  # after fit: the state it ended with
        if current is not None:  # called on every rank; rank 0 writes the file
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, current[1])
            checkpoint[CHECKPOINT_KEY] = {"algorithm": current[0], "ranks": states}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            return
        if self.hexagram_model is not None and not self.hexagram_model._setup_pending:
            self._load_algorithm_state(saved)
        else:  # Lightning restores the module before setup(): apply once wrapped
            self._pending_state = dict(saved)

    def _load_algorithm_state(self, saved: Mapping[str, Any]) -> None:
        wrapped = self.hexagram_model
        assert wrapped is not None
        ranks = saved["ranks"]
        if saved["algorithm"] != wrapped.algorithm.name or len(ranks) != dist.get_world_size():
            raise ConfigError(
                f"checkpoint holds {saved['algorithm']!r} state of {len(ranks)} ranks; this run "
                f"uses {wrapped.algorithm.name!r} on {dist.get_world_size()} ranks: resume with "
                "the same algorithm and world size, or drop the checkpoint's 'hexagram' key")
        wrapped.load_algorithm_state_dict(ranks[dist.get_rank()])
