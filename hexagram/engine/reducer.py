"""Gradient buckets driven by autograd hooks, launched in order as they become ready.

One :class:`Reducer` per wrapped model and gradient algorithm. During backward each
parameter's post-accumulate-grad hook copies its gradient into its bucket; when a bucket's
last gradient arrives (and every earlier bucket has been launched) the algorithm's
``bucket_ready`` starts its communication asynchronously, so communication overlaps the rest
of backward. A callback queued on the autograd engine runs once backward is over: it
launches what is left (unused parameters), waits every handle and writes the results into
``.grad``. Buckets are launched strictly by index, identically on every rank, which keeps
collectives in the same order everywhere.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from hexagram.algorithms.base import Algorithm
from hexagram.buckets import Bucket, BucketEntry
from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.device import control_tensor
from hexagram.engine.checks import FiniteGuard

__all__ = ["Reducer"]


class Reducer:
    """Hooks, readiness tracking and launch order for one set of gradient buckets.

    Args:
        algorithm: called with each ready bucket.
        comm: communicator used for the usage bitmap (``find_unused_parameters``).
        buckets: the buckets, in launch order.
        find_unused_parameters: allow parameters that get no gradient in a step.
        grad_as_view: make each ``.grad`` a view of its bucket (see
            :class:`~hexagram.engine.ddp.DistributedDataParallel`'s ``gradient_as_bucket_view``).
    """

    def __init__(self, algorithm: Algorithm, comm: Communicator, buckets: list[Bucket],
                 find_unused_parameters: bool, grad_as_view: bool = False) -> None:
        self.algorithm = algorithm
        self.grad_as_view = grad_as_view
        self.comm = comm
        self.buckets = buckets
        self.find_unused = find_unused_parameters
        self.enabled = True
        self.ready_order: list[str] = []  # names in the order grads arrived (first backward)
        self._where: dict[str, tuple[Bucket, BucketEntry]] = {
            e.name: (b, e) for b in buckets for e in b.entries}
        self._hooks = [e.param.register_post_accumulate_grad_hook(self._hook_for(e.name))
                       for b in buckets for e in b.entries]
        self._in_backward = False
        self._done: set[str] = set()
        self._next = 0
        self._handles: dict[int, Handle[torch.Tensor] | None] = {}
        self.backward_count = 0
        # the once-per-step non-finite check (None where the reduction carries NaN/Inf)
        self.guard: FiniteGuard | None = None
        self.match_guard()
        # results are multiplied by this before they reach .grad (join() sets it to
        # world / active ranks when the mean should be over the ranks that still train)
        self.grad_scale = 1.0
        # the wrapper's once-per-step read where no optimizer step hook makes it (None: the
        # optimizer's pre-hook reads); called after the algorithm's after_backward
        self.on_backward_end: Callable[[], None] | None = None

    def match_guard(self) -> None:
        """Build the non-finite check to match ``algorithm.passes_nonfinite`` and
        ``drops_nonfinite`` now: every gradient algorithm's reduced buckets are checked
        (what arrives); only those whose reduction would neither carry a NaN/Inf to every
        rank nor drop its sender also check (and clean) their gradients before it
        (``guard.local``).

        An algorithm that delegates (``auto``) declares what its current choice declares;
        the engine calls this before every forward, so a switch to or from allreduce adds
        or removes the check (and its cost) from the next step on."""
        local = not (self.algorithm.passes_nonfinite or self.algorithm.drops_nonfinite)
        if self.guard is None or self.guard.local != local:
            self.guard = FiniteGuard(self.buckets, self.comm, local=local)

    def remove(self) -> None:
        """Detach the autograd hooks (before re-bucketing or on close)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def release(self) -> None:
        """Detach the hooks and let go of the buckets, handles and guard (on close): what
        they hold on the device is freed as soon as nothing else refers to it."""
        self.remove()
        self.guard = None
        self._handles.clear()
        self._where.clear()
        self.buckets = []
        self.on_backward_end = None

    def _hook_for(self, name: str) -> Callable[[nn.Parameter], None]:
        # the parameter (the user's, long-lived) holds the hook; the hook holds the reducer
        # weakly, so a reducer whose wrapper is gone is not kept alive by the model
        ref = weakref.ref(self)

        def hook(_param: nn.Parameter) -> None:
            reducer = ref()
            if reducer is not None:
                reducer._on_grad(name)
        return hook

    def _start_backward(self) -> None:
        self._in_backward = True
        self._done.clear()
        self._next = 0
        self._handles.clear()
        for b in self.buckets:
            b.pending = len(b.entries)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_grad(self, name: str) -> None:
        if not self._in_backward:
            self._start_backward()
        if self.backward_count == 0:
            self.ready_order.append(name)
        if not self.enabled:
            return
        if name in self._done:
            raise RuntimeError(
                f"parameter {name!r} received its gradient twice in one backward pass (it is "
                "used by several reentrant backward calls); run those backwards under "
                "model.no_sync() except the last")
        self._done.add(name)
        bucket, entry = self._where[name]
        bucket.copy_in_grad(entry, as_view=self.grad_as_view)
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            bucket = self.buckets[self._next]
            if self.guard is not None and self.guard.local:
                self.guard.observe(bucket)  # no host read; the bucket is made finite
            self._handles[self._next] = self.algorithm.bucket_ready(bucket)
            self._next += 1

    def _finish_backward(self) -> None:
        self._in_backward = False
        self.backward_count += 1
        if not self.enabled:
            return
        missing = [e.name for b in self.buckets for e in b.entries if e.name not in self._done]
        if missing and not self.find_unused:
            raise RuntimeError(
                f"{len(missing)} parameter(s) received no gradient in this step, first "
                f"{missing[:5]}: wrap with find_unused_parameters=True if parts of the model "
                "are legitimately unused, or make sure the loss depends on every parameter")
        for name in missing:  # locally unused: contribute zeros, launch in order
            bucket, entry = self._where[name]
            bucket.release_grad(entry)  # a globally unused .grad must stay as it was
            bucket.view(entry).zero_()  # as DDP: an unused parameter contributes zero
            bucket.pending -= 1
        self._launch_ready()
        skip = self._globally_unused(missing) if self.find_unused else frozenset()
        self._collect(skip)

    def _collect(self, skip: frozenset[str]) -> None:
        """Wait every launched bucket, write the results into ``.grad``, end the step."""
        guard = self.guard
        if guard is not None:
            guard.agree()  # collective: after every bucket's, in the same order
        for index, handle in sorted(self._handles.items()):
            if handle is not None:
                result, bucket = handle.wait(), self.buckets[index]
                if guard is not None:  # what arrived, before anything is poisoned
                    guard.arrived(result)
                if not self.grad_as_view:
                    scaled = result * self.grad_scale if self.grad_scale != 1.0 else result
                    bucket.copy_out_grads(scaled, skip=skip)
                    if guard is not None:  # the .grad tensors (not the algorithm's)
                        guard.poison_grads(bucket, skip)
                    continue
                if result.data_ptr() != bucket.flat.data_ptr():
                    bucket.flat.copy_(result)
                if self.grad_scale != 1.0:  # in place: the gradients are views of flat
                    bucket.flat.mul_(self.grad_scale)
                if guard is not None:  # the engine's buffer, never the algorithm's
                    guard.poison(bucket, bucket.flat)
                bucket.attach_grads(skip)
        self._handles.clear()  # the results are in .grad: hold no device memory between steps
        self.algorithm.after_backward()
        if self.on_backward_end is not None:
            self.on_backward_end()

    def shadow(self) -> None:
        """Take part in one backward's collectives with zero gradients.

        A rank that has run out of data (see ``DistributedDataParallel.join``) calls this
        once per step its peers still take, so every collective finds all ranks; the
        reduced gradients of the peers land in ``.grad`` as they do on the active ranks.
        """
        names = [e.name for b in self.buckets for e in b.entries]
        if self.backward_count == 0 and not self.ready_order:
            self.ready_order = list(names)  # keeps the first-step re-bucketing collective
        self._done = set(names)
        self._next = 0
        self._handles.clear()
        for b in self.buckets:
            b.flat.zero_()
            b.pending = 0
        self._launch_ready()
        self.backward_count += 1
        skip = self._globally_unused(names) if self.find_unused else frozenset()
        self._collect(skip)

    def _globally_unused(self, missing: list[str]) -> frozenset[str]:
        """Names no rank used (their ``.grad`` stays as it was, like PyTorch DDP)."""
        names = [e.name for b in self.buckets for e in b.entries]
        gone = set(missing)
        used = control_tensor([n not in gone for n in names], self.comm)
        used = primitives.allreduce(self.comm, used, average=False).wait()
        return frozenset(n for n, u in zip(names, used.tolist()) if u == 0)
