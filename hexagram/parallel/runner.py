"""The model :func:`hexagram.parallel.parallelize` returns: one training step at a time.

A checkpoint of a planned run is, per rank: ``pm.module.state_dict()``, the optimizer's
state and ``pm.algorithm_state_dict()`` (the stage's dp-sync algorithm state: PowerSGD's Q
and residuals); restored in that order into a run of the same plan it continues
bit-identically.

Example:
    >>> pm = parallelize(model, plan)                           # doctest: +SKIP
    >>> opt = torch.optim.SGD(pm.parameters(), lr=0.1)          # doctest: +SKIP
    >>> loss = pm.train_step(x, y); opt.step(); opt.zero_grad() # doctest: +SKIP
    >>> torch.save(pm.algorithm_state_dict(), f"algo{rank}.pt") # doctest: +SKIP
    >>> pm.load_algorithm_state_dict(torch.load(f"algo{rank}.pt"))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hexagram.errors import HexagramError
from hexagram.parallel.hetero import CrossMeshPipeline
from hexagram.parallel.plans import Plan

__all__ = ["ParallelModel"]


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (collective over its mesh), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@dataclass
class ParallelModel:
    """This rank's share of a planned model.

    Attributes:
        module: the stage's layers (linears sharded over tp as DTensors).
        stage_index, dp_rank: where this rank sits in the plan.
        schedule: the pipelining schedule (None for a single stage; a
            :class:`~hexagram.parallel.hetero.CrossMeshPipeline` when stage shapes differ).
    """

    module: nn.Module
    plan: Plan
    stage_index: int
    dp_rank: int
    dp_group: dist.ProcessGroup
    schedule: Any
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    sync: Callable[..., None]
    #: where the stage runs (the runtime's: CPU with gloo, the rank's GPU with NCCL)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: what :func:`hexagram.parallel.auto` planned and measured (printable)
    report: str = ""

    @property
    def is_last(self) -> bool:
        return self.stage_index == len(self.plan.stages) - 1

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def _my_share(self, t: torch.Tensor) -> torch.Tensor:
        dp = self.plan.stages[self.stage_index].dp
        if t.shape[0] % (dp * self.plan.microbatches):
            raise HexagramError(f"batch {t.shape[0]} must divide into dp={dp} x "
                                f"{self.plan.microbatches} micro-batches")
        per = t.shape[0] // dp
        return t[self.dp_rank * per:(self.dp_rank + 1) * per]

    def _single_stage(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = x.new_zeros((), dtype=torch.float64)
        for xc, yc in zip(x.chunk(self.plan.microbatches), y.chunk(self.plan.microbatches)):
            loss = self.loss_fn(self.module(xc), yc) / self.plan.microbatches
            loss.backward()
            total += loss.detach().to(torch.float64)
        return total

    def _pipelined(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        if self.stage_index == 0:
            self.schedule.step(x)
        elif self.is_last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        if not self.is_last:
            return None
        return torch.stack([v.detach().to(torch.float64) for v in losses]).mean()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Forward + backward of the global batch (every rank passes the same one), then
        average gradients over dp; the batch is moved to the stage's device. Returns the
        mean loss on the last stage, else None."""
        if isinstance(self.schedule, CrossMeshPipeline):  # picks its rows per micro-batch
            loss = self.schedule.step(inputs, targets)
        else:
            x = self._my_share(inputs).to(self.device)
            y = self._my_share(targets).to(self.device)
            loss = self._single_stage(x, y) if self.schedule is None else \
                self._pipelined(x, y)
        self.sync(self.module, self.plan.stages[self.stage_index], self.dp_group)
        if loss is None:
            return None
        dp = self.plan.stages[self.stage_index].dp
        if dp > 1:
            dist.all_reduce(loss, group=self.dp_group)
        return float(loss) / dp

    def _where(self) -> dict[str, Any]:
        """This rank's place in the plan, as a checkpoint records it."""
        st = self.plan.stages[self.stage_index]
        return {"world": dist.get_world_size(), "rank": dist.get_rank(),
                "stage_index": self.stage_index, "stages": len(self.plan.stages),
                "layers": list(st.layers), "ranks": list(st.ranks), "dp": st.dp, "tp": st.tp}

    def algorithm_state_dict(self) -> dict[str, Any]:
        """This rank's state of its stage's dp-sync algorithm (PowerSGD's warm-start Q and
        error-feedback residuals, its step counter and random generators), with where it
        sits in the plan; ``torch.save``-able. Per rank: residuals differ across dp ranks.
        A stage with the built-in allreduce sync (or before its first step) has state None.
        """
        from hexagram.parallel.relax import stage_state

        return {"where": self._where(),
                "sync": stage_state(self.module, self.plan.stages[self.stage_index])}

    def load_algorithm_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`algorithm_state_dict` of the same rank of the same plan (before or
        after the first step); with the module's and the optimizer's state the run then
        continues exactly as it would have.

        Raises:
            HexagramError: the state is of another rank, stage or plan shape (both named).
            ConfigError: of another dp-sync algorithm or config, or other parameters.
        """
        from hexagram.parallel.relax import load_stage_state

        if not isinstance(state, dict) or set(state) != {"where", "sync"}:
            raise HexagramError("load_algorithm_state_dict expects what algorithm_state_dict "
                                f"returned (keys 'where', 'sync'), got {type(state).__name__}"
                                f"{sorted(state) if isinstance(state, dict) else ''}")
        mine = self._where()
        if state["where"] != mine:
            diff = {k: (state["where"].get(k), v) for k, v in mine.items()
                    if state["where"].get(k) != v}
            raise HexagramError(f"algorithm state saved by another rank or plan: (saved, this "
                                f"run) differ in {diff}; load each rank's own state into the "
                                f"same plan")
        load_stage_state(self.module, self.plan.stages[self.stage_index], state["sync"])

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Gradients of this stage's parameters, whole (collective over the stage's tp)."""
        return {n: _full(p.grad).detach().clone() for n, p in self.module.named_parameters()
                if p.grad is not None}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This stage's parameters, whole (collective over the stage's tp)."""
        return {n: _full(p.detach()).clone() for n, p in self.module.named_parameters()}
