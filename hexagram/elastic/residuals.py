"""Error-feedback residuals across a membership change of live mode.

A residual ``e_i`` is what rank ``i``'s compression has not sent yet. For PowerSGD the
update depends on the residuals only through their mean ``e_bar`` over the members (its
two allreduces are linear in ``M_i = g_i + e_i``), while each ``e_i = e_bar + d_i`` carries a
deviation ``d_i`` (summing to zero) that grows as the running sum of the rank's gradient
noise: harmless while every rank stays, but when replica ``k`` of ``n`` dies the
survivors' mean becomes ``e_bar - d_k / (n-1)``, applied to the model as if it were
gradient. ``benchmarks/elastic_residuals.py`` measured that shift at 2.3-14.7 times the
norm of one step's applied gradient (growing with the steps since the last re-centring)
against a mean residual of about one step's gradient (docs/benchmarks/elastic.md).

:func:`recenter` runs at the set-up of every epoch (collective, one allreduce of the
residuals), with one of three policies:

- ``"reset"`` (the default): every member's residuals := the mean of the up-to-date
  members' (a healed replica holds the same pending correction as the others, so a join
  changes nothing and no deviation is left); after a member was lost (an up-to-date
  member of the previous epoch is not one of this one), := zero: the survivors' mean now
  holds the dead replica's deviation, noise larger than the whole pending correction.
- ``"mean"``: the mean of the up-to-date members' residuals, also after a loss.
- ``"own"``: each member keeps its own; a healed replica starts at zero (its source's are
  the source's debt: copied, they would be applied twice).

Example:
    >>> recenter(model, epoch, replica=0, previous=(0, 1, 2), policy="reset", comm=comm)
    ... # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from hexagram.comm.communicator import Communicator
from hexagram.elastic.collectives import all_gather_object, all_reduce
from hexagram.elastic.quorum import Epoch
from hexagram.elastic.state import residual_tensors
from hexagram.errors import ConfigError

__all__ = ["POLICIES", "check_policy", "lost_member", "recenter"]

POLICIES = ("reset", "mean", "own")


def check_policy(policy: str) -> str:
    """``policy`` if it is one of :data:`POLICIES`, else :class:`ConfigError`."""
    if policy not in POLICIES:
        raise ConfigError(f"residuals={policy!r}: use one of {', '.join(POLICIES)} (see "
                          "hexagram.elastic.residuals)")
    return policy


def lost_member(epoch: Epoch, previous: tuple[int, ...] | None) -> bool:
    """True when a member of the ``previous`` epoch (this replica's last one) is not an
    up-to-date member of ``epoch``: it died, or came back without its state."""
    if previous is None:
        return False
    newest = max(epoch.steps)
    current = {m for m, s in zip(epoch.members, epoch.steps) if s == newest}
    return any(m not in current for m in previous)


def recenter(model: Any, epoch: Epoch, replica: int, previous: tuple[int, ...] | None,
             policy: str, comm: Communicator) -> None:
    """Apply ``policy`` (see the module doc) to ``model``'s residuals; collective over the
    epoch's process group (the default group, ``comm``: its set-up communicator, whose
    abort ends a wait on a failed member), called by every member at set-up.

    Raises:
        RuntimeError: the members hold residuals of different keys or shapes (a bug:
            members at one step of one algorithm hold the same).
    """
    if policy == "own":
        return
    state = model.algorithm_state_dict()
    residuals = residual_tensors(state)
    signature = [(k, tuple(t.shape), str(t.dtype)) for k, t in residuals.items()]
    seen = all_gather_object(comm, (signature, lost_member(epoch, previous)),
                             "re-centring the residuals")
    if any(s != signature for s, _ in seen):
        raise RuntimeError(f"epoch {epoch.number}: the members' error-feedback residuals "
                           "differ in keys or shapes; they cannot be re-centred")
    if not residuals:
        return
    newest = max(epoch.steps)
    flat = torch.cat([t.reshape(-1).double() for t in residuals.values()])
    if epoch.steps[epoch.rank_of(replica)] != newest:
        flat.zero_()  # healed: its residuals are not its own (zeroed by the healing)
    all_reduce(comm, flat, "re-centring the residuals")
    flat /= epoch.steps.count(newest)
    if policy == "reset" and any(lost for _, lost in seen):
        flat.zero_()
    offset = 0
    for t in residuals.values():
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    model.load_algorithm_state_dict(state)
