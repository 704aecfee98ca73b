"""Pipelines whose stages have different ``dp x tp`` meshes: GPipe / 1F1B schedules of our own.

``torch.distributed.pipelining`` links one rank per stage per pipeline, so it cannot join a
stage on 2 data-parallel ranks to one on a 2-way tensor-parallel mesh. Here every stage runs
its micro-batches in the plan's order (:func:`order`: GPipe, all forwards then all
backwards; or 1F1B, at most ``stages - index`` micro-batches in flight); between stages,
activations and their gradients move by cross-mesh resharding
(:mod:`hexagram.parallel.crossmesh`): each rank of the next stage receives exactly the rows
it needs from the ranks that hold them, point to point.

Rows: micro-batch ``m`` is rows ``[m * b, (m + 1) * b)`` of the global batch; data-parallel
index ``d`` of a stage with ``dp`` ranks takes its ``d``-th ``1/dp`` of them. Scaling: on a
stage with ``dp`` ranks every rank's gradients are ``dp`` times its rows' share (so the dp
average that :func:`~hexagram.parallel.apply.sync_gradients` or FSDP2 takes is the global
gradient); an activation gradient sent from a stage with ``dp_k`` ranks to one with
``dp_{k-1}`` is multiplied by ``dp_{k-1} / dp_k``. A tensor that does not scale with the
batch (e.g. position embeddings) is sent whole; its gradients are summed over the sender's
dp ranks and divided by their count.

Example:
    >>> pipe = CrossMeshPipeline(module, plan, index, bounds, loss_fn, device)  # doctest: +SKIP
    >>> loss = pipe.step(inputs, targets)     # the global batch, on every rank  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hexagram.errors import HexagramError
from hexagram.parallel.crossmesh import MeshLayout, exchange
from hexagram.parallel.plans import Plan, StagePlan
from hexagram.parallel.split import Boundary

__all__ = ["CrossMeshPipeline", "order"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: a micro-batch between its forward and backward: inputs, outputs, loss (last stage)
_Saved = tuple[list[torch.Tensor], tuple[torch.Tensor, ...], torch.Tensor | None]


def _layout(st: StagePlan, batch: bool, partial: bool = False) -> MeshLayout:
    return MeshLayout(ranks=tuple(st.ranks), dp=st.dp, tp=st.tp, batch=batch,
                      partial=partial)


def _shape(b: Boundary, rows: int) -> tuple[int, ...]:
    """The global shape of boundary tensor ``b`` for one micro-batch of ``rows`` rows."""
    return (rows, *b.shape[1:]) if b.batch else b.shape


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def order(stages: int, index: int, microbatches: int, schedule: str) -> list[tuple[str, int]]:
    """Stage ``index``'s sequence of ``("F", m)`` / ``("B", m)`` steps.

    Sends never block (their requests are waited at the end of the step) and receives come
    in the order the neighbour sends, so the stages cannot wait on each other in a cycle.

    Example:
        >>> order(2, 0, 3, "1f1b")  # stage 0 of 2, 3 micro-batches
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    if schedule == "gpipe":
        return [("F", m) for m in range(microbatches)] + \
            [("B", m) for m in reversed(range(microbatches))]
    warm = min(stages - 1 - index, microbatches)
    steady = [step for i in range(microbatches - warm) for step in (("F", warm + i), ("B", i))]
    return [("F", m) for m in range(warm)] + steady + \
        [("B", m) for m in range(microbatches - warm, microbatches)]


class CrossMeshPipeline:
    """This rank's stage of a pipeline over stage meshes of any shapes (see the module doc).

    ``bounds[k]``: the tensors crossing from stage ``k`` to ``k + 1``
    (:func:`hexagram.parallel.split.boundaries`); ``module``: this rank's stage, taking the
    previous boundary's tensors (the model inputs on stage 0) and returning the next's.
    """

    def __init__(self, module: nn.Module, plan: Plan, index: int,
                 bounds: list[list[Boundary]], loss_fn: LossFn, device: torch.device) -> None:
        self.module, self.plan, self.index = module, plan, index
        self.bounds, self.loss_fn, self.device = bounds, loss_fn, device
        self.stage = plan.stages[index]
        self.dp_index = self.stage.ranks.index(torch.distributed.get_rank()) // self.stage.tp
        self._pending: list[tuple[list[torch.distributed.Work], list[Any]]] = []

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == len(self.plan.stages) - 1

    def _rows(self, t: torch.Tensor, m: int) -> torch.Tensor:
        """This rank's rows of micro-batch ``m`` of a global-batch tensor."""
        b = t.shape[0] // self.plan.microbatches
        per = b // self.stage.dp
        start = m * b + self.dp_index * per
        return t[start:start + per].to(self.device)

    def _move(self, k: int, tensors: list[torch.Tensor | None], rows: int,
              backward: bool) -> list[torch.Tensor | None]:
        """Reshard boundary ``k``'s tensors forward (stage k -> k+1) or their gradients
        backward (only floating-point ones); every rank of both stages calls it."""
        a, b = self.plan.stages[k], self.plan.stages[k + 1]
        bounds = [x for x in self.bounds[k] if not backward or x.dtype.is_floating_point]
        src = [_layout(b, x.batch, partial=not x.batch) if backward else _layout(a, x.batch)
               for x in bounds]
        dst = [_layout(a if backward else b, x.batch) for x in bounds]
        return exchange(tensors, [_shape(x, rows) for x in bounds], [x.dtype for x in bounds],
                        src, dst, self.device, pending=self._pending)

    def _forward(self, x: torch.Tensor, y: torch.Tensor, m: int, rows: int) -> _Saved:
        if self.is_first:
            inputs = [self._rows(x, m)]
        else:
            got = self._move(self.index - 1, [None] * len(self.bounds[self.index - 1]), rows,
                             backward=False)
            inputs = [t.requires_grad_(t.is_floating_point()) for t in got if t is not None]
        out = _as_tuple(self.module(*inputs))
        if self.is_last:
            return inputs, out, self.loss_fn(out[0], self._rows(y, m)) / self.plan.microbatches
        self._move(self.index, [t.detach() for t in out], rows, backward=False)
        return inputs, out, None

    def _backward(self, inputs: list[torch.Tensor], out: tuple[torch.Tensor, ...],
                  loss: torch.Tensor | None, rows: int) -> None:
        if loss is not None:
            loss.backward()
        else:
            floats = [t for t in out if t.is_floating_point()]
            grads = self._move(self.index, [None] * len(floats), rows, backward=True)
            pairs = [(t, g) for t, g in zip(floats, grads) if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if self.is_first:
            return
        prev = self.plan.stages[self.index - 1]
        send = []
        for t, bd in zip(inputs, self.bounds[self.index - 1]):
            if not t.is_floating_point():
                continue
            g = t.grad if t.grad is not None else torch.zeros_like(t)
            send.append(g * (prev.dp / self.stage.dp) if bd.batch else g / self.stage.dp)
        self._move(self.index - 1, list(send), rows, backward=True)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of the global batch (the same on every rank); returns the
        sum over micro-batches of ``loss / microbatches`` on the last stage, else None."""
        n = self.plan.microbatches
        for st in self.plan.stages:
            if inputs.shape[0] % (n * st.dp):
                raise HexagramError(f"batch {inputs.shape[0]} must divide into "
                                    f"{n} micro-batches x dp={st.dp}")
        rows = inputs.shape[0] // n
        saved: dict[int, _Saved] = {}
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for kind, m in order(len(self.plan.stages), self.index, n, self.plan.schedule):
            if kind == "F":
                saved[m] = self._forward(inputs, targets, m, rows)
                loss = saved[m][2]
                if loss is not None:
                    total += loss.detach().to(torch.float64)
            else:
                ins, out, mb_loss = saved.pop(m)
                self._backward(ins, out, mb_loss, rows)
        for works, _ops in self._pending:
            for work in works:
                work.wait()
        self._pending.clear()
        return total if self.is_last else None
