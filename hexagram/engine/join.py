"""Uneven inputs across ranks: PyTorch's ``Join`` protocol, for Hexagram's wrapper.

The wrapper is a ``torch.distributed.algorithms.join.Joinable``: ``with Join([model]):`` and
``with model.join(...):`` (which is ``Join([model], ...)``, as in PyTorch DDP) let ranks
leave their data loop after different numbers of steps. The protocol is PyTorch's:

- each forward of a rank still training calls ``Join.notify_join_context`` (one tiny
  allreduce on :attr:`Joinable.join_process_group`; with ``throw_on_early_termination``
  a second one, and every rank raises ``RuntimeError`` once one has run out of inputs),
  then allreduces a *control* vector ``[active, syncing]`` on the wrapper's own group
  (``syncing = 0`` under ``no_sync()`` or ``torch.no_grad()``);
- a rank that has left the ``with`` block runs :meth:`_JoinHook.main_hook` once per step
  its peers still take: it answers the control round with ``[0, 0]``, the pre-forward
  collectives, and the backward's bucket collectives with zero gradients
  (:meth:`hexagram.engine.reducer.Reducer.shadow`); it also steps the wrapper's optimizers
  with the reduced gradient, so its optimizer state keeps up;
- :meth:`_JoinHook.post_hook` broadcasts the parameters (and buffers, when buffers are
  synchronised) of the highest rank among the last to join, as PyTorch DDP.

Gradients are divided by the world size (``divide_by_initial_world_size=True``, joined ranks
count as zeros) or by the ranks still training. Weight algorithms (local SGD, DiLoCo, ...)
carry a join protocol in their own rounds: ``model.join()`` then calls :meth:`synchronize`
when the block ends, and ``Join([model])`` is refused with that fix.

Example:
    >>> common_rank(torch.tensor([0, 1, 1]))
    2
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook
from torch.distributed.algorithms.join import Joinable as TorchJoinable

from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator
from hexagram.comm.control import count_flags
from hexagram.comm.device import control_zeros, group_device
from hexagram.errors import ConfigError

__all__ = ["Joinable", "common_rank", "control_round", "default_group"]


def control_round(comm: Communicator, active: bool, syncing: bool) -> tuple[int, int]:
    """Allreduce ``[active, syncing]``; (ranks active, ranks that will sync gradients)."""
    counts = count_flags(comm, active=active, syncing=active and syncing).wait()
    return counts.active, counts.syncing


def common_rank(candidates: torch.Tensor) -> int:
    """The highest rank whose entry of ``candidates`` (world,) is set (PyTorch DDP's
    ``_find_common_rank``); -1 when none is."""
    ranks = torch.nonzero(candidates).flatten()
    return int(ranks.max().item()) if ranks.numel() else -1


def _agree_on_rank(comm: Communicator, candidate: bool) -> int:
    """One allreduce: the highest rank that is a candidate (identical on every rank)."""
    flags = control_zeros(comm.size, comm)
    flags[comm.rank] = int(candidate)
    return common_rank(primitives.allreduce(comm, flags, average=False).wait())


class _JoinHook(JoinHook):
    """The wrapper's part in ``Join``'s loop (see the module docstring)."""

    def __init__(self, ddp: Joinable, divide_by_initial_world_size: bool) -> None:
        super().__init__()
        self.ddp = ddp
        ddp._divide_by_world = divide_by_initial_world_size

    def main_hook(self) -> None:
        self.ddp._shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


class Joinable(TorchJoinable):
    """PyTorch's ``Joinable`` interface and ``join()`` of
    :class:`~hexagram.engine.ddp.DistributedDataParallel` (a mixin): the wrapper's state it
    reads is declared here, the wrapper sets it."""

    comm: Communicator
    algorithm: Any
    module: torch.nn.Module
    optimizers: list[torch.optim.Optimizer]
    process_group: Any
    broadcast_buffers: bool
    _reducer: Any
    _divide_by_world: bool
    _grad_scale: float  # the reducer's, kept by the wrapper: a rebuilt reducer takes it

    def _prepare_forward(self, joined: bool = False) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def _broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        raise NotImplementedError

    # -- torch.distributed.algorithms.join.Joinable ---------------------------------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook ``Join`` runs on a rank that ran out of inputs (kwargs:
        ``divide_by_initial_world_size``, default True)."""
        if self.algorithm.kind == "weight":
            raise ConfigError(
                f"Join([model]) with weight algorithm {self.algorithm.name!r}: its rounds "
                "carry their own join protocol; use `with model.join():` (or call "
                "model.synchronize() on every rank once its data ends)")
        return _JoinHook(self, bool(kwargs.get("divide_by_initial_world_size", True)))

    @property
    def join_device(self) -> torch.device:
        """Where ``Join``'s own allreduces live (the device of :attr:`join_process_group`)."""
        return group_device(self.join_process_group)

    @property
    def join_process_group(self) -> Any:
        """The group of ``Join``'s own allreduces: the wrapper's ``process_group`` (the
        default group unless one was given), as PyTorch DDP."""
        return self.process_group

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> contextlib.AbstractContextManager[Any]:
        """Train on uneven inputs: ranks may leave their data loop after different steps.

        PyTorch DDP's ``join()``: ``Join([model], enable, throw_on_early_termination,
        divide_by_initial_world_size=...)``; see the module docstring for the protocol.

        Args:
            divide_by_initial_world_size: average gradients over all ranks (joined ranks
                count as zeros, PyTorch DDP's default); False averages over the ranks still
                training.
            enable: False makes this a no-op (same code path with even inputs).
            throw_on_early_termination: every rank raises ``RuntimeError`` as soon as one
                has run out of inputs (from its forward, or from leaving the block),
                instead of shadowing.

        One forward per backward inside the block. Collective: every rank must enter it.
        With a weight algorithm, leaving the block calls :meth:`synchronize` (its rounds
        carry the join protocol); ``throw_on_early_termination`` is refused there.

        Example::

            with model.join():
                for x, y in my_shard:            # lengths differ across ranks
                    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        """
        if self.algorithm.kind != "weight":
            return Join([self], enable, throw_on_early_termination,
                        divide_by_initial_world_size=divide_by_initial_world_size)
        if throw_on_early_termination and enable:
            raise ConfigError(
                f"join(throw_on_early_termination=True) with weight algorithm "
                f"{self.algorithm.name!r}: its rounds let ranks finish at different steps "
                "and agree at synchronize(); use model.join() without it")
        return self._join_weights(enable)

    @contextlib.contextmanager
    def _join_weights(self, enable: bool) -> Iterator[None]:
        yield
        if enable and self.comm.size > 1:
            self.synchronize()

    # -- the protocol ---------------------------------------------------------------------
    def _notify_join(self, syncing: bool) -> None:
        """A rank still training, before its forward's collectives (inside ``Join``)."""
        work = Join.notify_join_context(self)  # raises when told to throw
        if work is not None:
            work.wait()  # matched by the joined ranks' count in Join's loop
        self._join_round(active=True, syncing=syncing)

    def _join_round(self, active: bool, syncing: bool) -> tuple[int, int]:
        """One control round; sets the gradient scale for the step that follows."""
        ranks, syncs = control_round(self.comm, active, syncing)
        self._set_grad_scale(self.comm.size / ranks if ranks and not self._divide_by_world
                             else 1.0)
        return ranks, syncs

    def _set_grad_scale(self, scale: float) -> None:
        """Reduced gradients are multiplied by ``scale`` (world / active ranks), also by a
        reducer rebuilt before the backward (the first step's re-bucketing)."""
        self._grad_scale = scale
        if self._reducer is not None:
            self._reducer.grad_scale = scale

    def _shadow_step(self) -> None:
        """A joined rank mirrors one step of its peers (zero gradients)."""
        _, syncing = self._join_round(active=False, syncing=False)
        self._prepare_forward(joined=True)
        if syncing and self._reducer is not None:
            self._reducer.shadow()
            for opt in self.optimizers:  # keep replica and optimizer state in step
                opt.step()
                opt.zero_grad()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters (and synchronised buffers) of the highest rank
        among the last to join."""
        self._set_grad_scale(1.0)
        src = _agree_on_rank(self.comm, is_last_joiner)
        tensors: list[torch.Tensor] = list(self.module.parameters())
        if self.broadcast_buffers:
            tensors += list(self.module.buffers())
        self._broadcast(tensors, src=src)

    def _buffer_source(self, joined: bool) -> int:
        """Rank whose buffers every rank takes before a forward: 0, or inside ``Join`` the
        highest rank still training (a joined rank's buffers are stale, as PyTorch's)."""
        if not self._join_config.enable:
            return 0
        return _agree_on_rank(self.comm, not joined)


def default_group(process_group: Any, device_mesh: Any) -> Any:
    """The group PyTorch DDP calls ``process_group``: the one given, the mesh's, or the
    default group."""
    if process_group is not None:
        return process_group
    if device_mesh is not None:
        return device_mesh.get_group(mesh_dim=0)
    return dist.group.WORLD
