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

import torch

from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator
from hexagram.comm.control import count_flags
from hexagram.comm.device import control_zeros

__all__ = ["authoritative_rank", "control_round", "trained_steps"]


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
