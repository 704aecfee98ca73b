"""CPU an algorithm spends outside its compressor, timed on the job's own shapes.

The compressor's encode and decode (:func:`hexagram.cost.profile.measure_compressor`) are
not all the CPU of every algorithm. gTop-k's tree (:mod:`hexagram.comm.gtopk`) sorts this
rank's ``k`` pairs by index, then in each of its ``ceil(log2 P)`` rounds packs them, unpacks
the partner's, merges the two sparse sets (a stable sort of ``2k`` indices, the sums of
shared ones, a top-k of the union) and checks which of its own pairs survived; finally the
result is written into the segment: far more than the few decodes of the payload a
generic gathered format costs (docs/benchmarks/auto.md has the measured figures).

:func:`gtopk_tree_cost` runs those very functions (``merge_topk`` and the helpers the
collective calls) on two of the job's tensor shapes, with the algorithm's own compressor
making the pairs, and fits ``a + b n`` per segment of ``n`` elements
(:class:`~hexagram.cost.profile.TreeCost`). Only local work is timed: the partner's pairs
come from a second random tensor, as a partner's would.

QAdam (:mod:`hexagram.algorithms.qadam`) turns each bucket's gradient into its
preconditioned momentum before the encode, ``x = ((1 - beta) g + beta m) / d`` (three
passes on the training thread), and back into the gradient the optimizer needs after the
exchange, ``g = (u d - beta m) / (1 - beta)`` (three passes on the communication thread).
:func:`qadam_own_cost` times both, on the job's shapes, as ``once`` and ``per_round``
(one round). :func:`optimizer_step_s` times one step of an optimizer on the job's
shapes: the lab profiles every cell's compute with SGD and momentum, and QAdam's runs
:class:`~hexagram.optim.QAdamOptimizer` (Adam with a frozen variance) instead, which
:func:`hexagram.algorithms.qadam.optimizer_extra_s` times with it. Each algorithm with work
of its own says so (``own_work``) and times it (``own_work_cost``): this module never imports
one (:mod:`hexagram.cost.facts`).

Example:
    >>> import hexagram as hx
    >>> cost = gtopk_tree_cost(hx.algorithms.get("gtopk"), ((64, 64), (256, 256)))
    >>> cost.seconds(65536, 2) > cost.seconds(4096, 2) > 0
    True
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hexagram.cost.facts import Priced, Shapes, compressor_of
from hexagram.cost.fit import line_through
from hexagram.cost.profile import ComputeProfile, TreeCost, device_clock
from hexagram.cost.stopwatch import fastest

__all__ = ["gtopk_tree_cost", "job_compute", "optimizer_step_s", "qadam_own_cost"]

def _pairs(comp: Any, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    from hexagram.comm.gtopk import sparse_pairs

    return sparse_pairs(comp.compress(torch.randn(n, generator=gen), gen))


def _segment_times(algorithm: Priced, n: int, reps: int,
                   clock: Callable[[], float]) -> tuple[float, float]:
    """(once, one round) CPU seconds of gTop-k's own work on a segment of ``n`` elements."""
    from hexagram.comm.gtopk import _isin, _pack, _sort_pairs, _unpack, merge_topk

    gen = torch.Generator().manual_seed(0)
    comp = compressor_of(algorithm)
    assert comp is not None, f"{algorithm.name}: gTop-k's tree needs its sparsifier"
    values, indices = _pairs(comp, n, gen)
    k = values.numel()
    theirs_v, theirs_i, _ = _sort_pairs(*_pairs(comp, n, gen))
    sort_s, (v, i, _) = fastest(lambda: _sort_pairs(values.clone(), indices.clone()), reps,
                              clock)
    pack_s, buf = fastest(lambda: _pack(v, i), reps, clock)
    unpack_s, _ = fastest(lambda: _unpack(buf, k, v.dtype), reps, clock)
    merge_s, (gv, gi) = fastest(lambda: merge_topk(v, i, theirs_v, theirs_i, k), reps, clock)
    check_s, _ = fastest(lambda: _isin(i, gi), reps, clock)
    out = torch.empty(n)
    write_s, _ = fastest(lambda: out.zero_().index_put_((gi,), gv / 2), reps, clock)
    return sort_s + write_s, pack_s + unpack_s + merge_s + check_s


def gtopk_tree_cost(algorithm: Priced, sizes: Shapes, reps: int = 2,
                    device: torch.device | str = "cpu") -> TreeCost:
    """gTop-k's own tree work (module doc) timed at the two ``sizes`` (element counts
    taken from the shapes), best of ``reps``, fitted to ``a + b n`` per part; CPU seconds
    of this thread (:func:`~hexagram.cost.profile.device_clock`)."""
    clock = device_clock(device)
    (n0, n1) = (max(2, math.prod(s)) for s in sizes)
    (o0, r0), (o1, r1) = (_segment_times(algorithm, n, reps, clock) for n in (n0, n1))
    return TreeCost(line_through(n0, o0, n1, o1), line_through(n0, r0, n1, r1))


def _qadam_times(n: int, beta: float, reps: int, clock: Callable[[], float]
                 ) -> tuple[float, float]:
    """(to momentum, back to gradient) CPU seconds on ``n`` elements, the operations of
    :meth:`hexagram.algorithms.qadam.QAdamAlgorithm.bucket_ready` in the same order."""
    gen = torch.Generator().manual_seed(0)
    g, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    d = torch.rand(n, generator=gen).add_(0.5)
    to_s, _ = fastest(lambda: g.mul_(1 - beta).add_(m, alpha=beta).div_(d), reps, clock)
    back_s, _ = fastest(lambda: g.mul_(d).sub_(m, alpha=beta).div_(1 - beta), reps, clock)
    return to_s, back_s


def qadam_own_cost(algorithm: Priced, sizes: Shapes, reps: int = 3,
                   device: torch.device | str = "cpu") -> TreeCost:
    """QAdam's momentum arithmetic (module doc) timed at the two ``sizes``, best of
    ``reps``: ``once`` is the transform before the encode (training thread),
    ``per_round`` the one after the exchange (one round). CPU seconds of this thread.

    >>> import hexagram as hx
    >>> cost = qadam_own_cost(hx.algorithms.get("qadam"), ((64, 64), (512, 512)))
    >>> cost.seconds(262144, 1) > cost.seconds(4096, 1) > 0
    True
    """
    del algorithm  # beta1 is the optimizer's; its value does not change the work
    clock = device_clock(device)
    (n0, n1) = (max(2, math.prod(s)) for s in sizes)
    (a0, b0), (a1, b1) = (_qadam_times(n, 0.9, reps, clock) for n in (n0, n1))
    return TreeCost(line_through(n0, a0, n1, a1), line_through(n0, b0, n1, b1))


def optimizer_step_s(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                     shapes: Sequence[tuple[int, ...]], reps: int = 3, warm: int = 2
                     ) -> float:
    """CPU seconds (this thread) of one ``make(params).step()`` on parameters of
    ``shapes`` with gradients, after ``warm`` untimed steps (state created; QAdam's
    variance frozen with ``warmup_steps=1``); the best of ``reps``.

    >>> sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    >>> optimizer_step_s(sgd, [(256, 256)]) > 0
    True
    """
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(*p.shape, generator=gen) * 1e-3
    opt = make(params)
    for _ in range(warm):
        opt.step()
    best, _ = fastest(opt.step, reps, time.thread_time)
    return best


def job_compute(name: str, compute: ComputeProfile, extra_s: float) -> ComputeProfile:
    """``compute`` (profiled with SGD and momentum) as algorithm ``name``'s job runs it:
    QAdam's optimizer step costs ``extra_s`` more
    (:func:`hexagram.algorithms.qadam.optimizer_extra_s`), added to
    the update and to the CPU; other algorithms as profiled.

    >>> c = ComputeProfile(0.0, 0.10, 0.01, [], [], cpu_s=0.08)
    >>> q = job_compute("qadam", c, 0.02)
    >>> round(q.update_s, 3), round(q.cpu_s, 3), job_compute("topk", c, 0.02) is c
    (0.03, 0.1, True)
    """
    if name != "qadam" or extra_s <= 0:
        return compute
    cpu = None if compute.cpu_s is None else compute.cpu_s + extra_s
    return dataclasses.replace(compute, update_s=compute.update_s + extra_s, cpu_s=cpu)

