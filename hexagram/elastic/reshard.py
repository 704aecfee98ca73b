"""Resume on another number of ranks: fold per-rank state, or refuse naming the entry.

Given the saved states of the ``W`` old ranks (same nesting), :func:`merge_states` builds
the state of new rank ``r`` of ``W'``, entry by entry (a leaf is a tensor or a Python value):

- equal on every old rank (replicated weights and optimizer state of gradient algorithms,
  PowerSGD's warm-start Q, DiLoCo's anchor and outer momentum, counters): taken as is;
- floating-point and different (error-feedback residuals, replicas of local SGD /
  decentralized between rounds): **folded**, the mean over old ranks. For residuals this
  keeps the pending correction of the averaged gradient, ``sum_r e_r / W``, unchanged
  (each of the ``W'`` ranks re-injects the mean); for replicas it is one averaging round;
- anything else that differs (RNG states, per-rank counters): new rank ``r`` takes old rank
  ``r``'s (so 4 -> 3 works); a new rank with no old counterpart (growth) gets a
  :class:`CheckpointError` naming the entry; its global RNG (``rng/...``) is simply not
  restored.

Example:
    >>> a, b = {"e": torch.tensor([1.0]), "n": 2}, {"e": torch.tensor([3.0]), "n": 2}
    >>> merged, notes = merge_states([a, b], new_rank=0)
    >>> merged["e"].item(), merged["n"], notes["folded"]
    (2.0, 2, ['e'])
"""

from __future__ import annotations

from typing import Any

import torch

from hexagram.elastic.state import CheckpointError

__all__ = ["merge_states"]


def _equal(values: list[Any]) -> bool:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return all(isinstance(v, torch.Tensor) and v.shape == first.shape
                   and v.dtype == first.dtype and torch.equal(v, first) for v in values[1:])
    return all(type(v) is type(first) and v == first for v in values[1:])


class _Merger:
    def __init__(self, old_world: int, new_rank: int) -> None:
        self.old_world, self.new_rank = old_world, new_rank
        self.notes: dict[str, list[str]] = {"folded": [], "per_rank": []}

    def merge(self, values: list[Any], path: str) -> Any:
        first = values[0]
        if isinstance(first, dict):
            keys = list(first)
            if any(not isinstance(v, dict) or list(v) != keys for v in values):
                return self.own(values, path)
            return {k: self.merge([v[k] for v in values], f"{path}/{k}" if path else str(k))
                    for k in keys}
        if isinstance(first, (list, tuple)):
            if any(type(v) is not type(first) or len(v) != len(first) for v in values):
                return self.own(values, path)
            items = [self.merge([v[i] for v in values], f"{path}/{i}" if path else str(i))
                     for i in range(len(first))]
            return items if isinstance(first, list) else tuple(items)
        if _equal(values):
            return first
        if isinstance(first, torch.Tensor) and first.is_floating_point() and all(
                isinstance(v, torch.Tensor) and v.shape == first.shape for v in values):
            self.notes["folded"].append(path)
            return torch.stack([v.to(first.dtype) for v in values]).mean(0)
        return self.own(values, path)

    def own(self, values: list[Any], path: str) -> Any:
        if self.new_rank < self.old_world:
            self.notes["per_rank"].append(path)
            return values[self.new_rank]
        raise CheckpointError(
            f"checkpoint entry {path!r} is per-rank state that cannot be folded (it differs "
            f"across the {self.old_world} saved ranks and is not a floating-point tensor of "
            f"one shape), and new rank {self.new_rank} has no saved counterpart; resume with "
            f"at most {self.old_world} ranks")


def merge_states(states: list[dict[str, Any]], new_rank: int
                 ) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """State of ``new_rank`` from the old ranks' ``states``, and notes on what was folded."""
    merger = _Merger(len(states), new_rank)
    rng = states[new_rank].get("rng") if new_rank < len(states) else None
    body = [{k: v for k, v in s.items() if k != "rng"} for s in states]
    merged = merger.merge(body, "")
    merged["rng"] = rng  # global RNG is per rank: own rank's, or left as it is
    return merged, merger.notes
