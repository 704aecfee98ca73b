"""The collectives behind ``DistributedDataParallel.join()``: uneven inputs across ranks.

With gradient algorithms every step is a set of collectives all ranks must enter. Inside
``join()`` each forward first allreduces a tiny *control* vector ``[active, syncing]``:
a rank still training sends ``[1, 1]`` (``syncing = 0`` under ``no_sync()`` or
``torch.no_grad()``, so a joined rank knows no gradient collective follows). A rank that
has run out of data leaves the ``with`` block and answers with ``[0, 0]``, shadowing each
step of its peers (:meth:`hexagram.engine.reducer.Reducer.shadow`) until a control round
reports no active rank. Every rank then takes the weights and buffers of a rank that
trained longest (the *authoritative* rank), as PyTorch DDP's join does.

Example:
    >>> authoritative_rank(torch.tensor([3, 5, 5]))
    1
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator
from hexagram.comm.control import count_flags
from hexagram.comm.device import control_zeros

__all__ = ["Joinable", "authoritative_rank", "control_round", "trained_steps"]


def control_round(comm: Communicator, active: bool, syncing: bool) -> tuple[int, int]:
    """Allreduce ``[active, syncing]``; (ranks active, ranks that will sync gradients)."""
    counts = count_flags(comm, active=active, syncing=active and syncing).wait()
    return counts.active, counts.syncing


def trained_steps(comm: Communicator, steps: int) -> torch.Tensor:
    """(world,) steps each rank trained inside ``join()`` (one allreduce)."""
    counts = control_zeros(comm.size, comm)
    counts[comm.rank] = steps
    return primitives.allreduce(comm, counts, average=False).wait()


def authoritative_rank(steps: torch.Tensor) -> int:
    """The lowest rank among those that trained the most steps (identical everywhere)."""
    return int(torch.nonzero(steps == steps.max())[0].item())


class Joinable:
    """``join()`` of :class:`~hexagram.engine.ddp.DistributedDataParallel` (a mixin): the
    wrapper's state it reads is declared here, the wrapper sets it."""

    comm: Communicator
    algorithm: Any
    module: torch.nn.Module
    optimizers: list[torch.optim.Optimizer]
    _reducer: Any
    _joining: bool
    _join_steps: int
    _divide_by_world: bool

    def _prepare_forward(self) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def _broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True,
             enable: bool = True) -> Iterator[None]:
        """Train on uneven inputs: ranks may leave their data loop after different steps.

        Wrap the whole loop: ``with model.join(): for x, y in loader: ...``. Inside, each
        forward of a gradient algorithm starts with a tiny control allreduce; a rank that
        leaves the block keeps answering its peers' steps with zero gradients (and steps
        the wrapper's ``optimizers`` with the reduced gradient, so its replica and optimizer
        state keep up) until every rank has left; then all ranks take the parameters and
        buffers of a rank that trained the most steps. Weight algorithms run their own join
        protocol: leaving the block calls :meth:`synchronize`.

        Args:
            divide_by_initial_world_size: average gradients over all ranks (joined ranks
                count as zeros, PyTorch DDP's default); False averages over the ranks still
                training.
            enable: False makes this a no-op (same code path with even inputs).

        One forward per backward inside the block (as with PyTorch's join). Collective: every
        rank must enter it.

        Example::

            with model.join():
                for x, y in my_shard:            # lengths differ across ranks
                    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        """
        if not enable or self.comm.size == 1:
            yield
            return
        if self.algorithm.kind == "weight":
            yield
            self.synchronize()
            return
        self._joining, self._join_steps = True, 0
        self._divide_by_world = divide_by_initial_world_size
        try:
            yield
        finally:
            self._joining = False
        self._shadow_until_everyone_joined()
        self._take_authoritative_model()

    def _join_round(self, active: bool, syncing: bool) -> tuple[int, int]:
        """One control round; sets the gradient scale for the step that follows."""
        ranks, syncs = control_round(self.comm, active, syncing)
        if self._reducer is not None:
            scale = self.comm.size / ranks if ranks and not self._divide_by_world else 1.0
            self._reducer.grad_scale = scale
        return ranks, syncs

    def _shadow_until_everyone_joined(self) -> None:
        """Mirror the peers' steps (zero gradients) until no rank is active."""
        while True:
            active, syncing = self._join_round(active=False, syncing=False)
            if active == 0:
                break
            self._prepare_forward()
            if syncing and self._reducer is not None:
                self._reducer.shadow()
                for opt in self.optimizers:  # keep replica and optimizer state in step
                    opt.step()
                    opt.zero_grad()
        if self._reducer is not None:
            self._reducer.grad_scale = 1.0

    def _take_authoritative_model(self) -> None:
        """Every rank takes the weights and buffers of a rank that trained the longest."""
        steps = trained_steps(self.comm, self._join_steps)
        src = authoritative_rank(steps)
        self._broadcast(list(self.module.parameters()) + list(self.module.buffers()), src=src)
