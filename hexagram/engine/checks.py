"""Consistency checks: at wrap time across ranks, and the per-step non-finite check.

A model that differs across ranks (a parameter missing, a different shape or dtype) would
otherwise hang or corrupt a collective. Every rank gathers every rank's signature and raises
the same clear error naming the first differing parameter. Layers that cannot run where the
model is (SyncBatchNorm off the GPU) and a model on another device than the runtime's are
refused at wrap time, not at the first forward.

:class:`FiniteGuard` is the engine's non-finite gradient check (once per step, on the
device; see its docstring). Algorithms do not check gradients themselves: the engine calls
the guard around ``bucket_ready`` for every gradient algorithm whose ``passes_nonfinite`` is
False, so a NaN/Inf never reaches a compressor and an overflow reaches every rank's
``GradScaler``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from hexagram.algorithms.finite import StepChecks
from hexagram.buckets import Bucket
from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.device import CONTROL_DTYPE
from hexagram.errors import ConfigError, ModelMismatchError, NonFiniteGradientError

__all__ = ["FiniteGuard", "agree_finite_grads", "at_end_of_backward", "check_model_device",
           "check_runs_on", "check_same_model", "fp16_autocast", "model_signature",
           "read_step_checks"]

Signature = list[tuple[str, tuple[int, ...], str, bool]]


def model_signature(module: nn.Module) -> Signature:
    """(name, shape, dtype, requires_grad) of every parameter and buffer, in order."""
    sig: Signature = [(f"param {n}", tuple(p.shape), str(p.dtype), p.requires_grad)
                      for n, p in module.named_parameters()]
    sig += [(f"buffer {n}", tuple(b.shape), str(b.dtype), False)
            for n, b in module.named_buffers()]
    return sig


def _first_difference(mine: Signature, ref: Signature) -> str | None:
    for i in range(max(len(mine), len(ref))):
        a = mine[i] if i < len(mine) else None
        b = ref[i] if i < len(ref) else None
        if a != b:
            def show(x: tuple[str, tuple[int, ...], str, bool] | None) -> str:
                return "nothing" if x is None else f"{x[0]} shape={list(x[1])} dtype={x[2]} " \
                    f"requires_grad={x[3]}"
            return f"entry {i}: {show(a)} vs rank 0's {show(b)}"
    return None


def check_same_model(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`ModelMismatchError` on every rank if any rank's model differs.

    Collective over ``group``: every rank must call it.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return
    sigs: list[Signature | None] = [None] * size
    dist.all_gather_object(sigs, model_signature(module), group=group)
    ref = sigs[0]
    assert ref is not None
    for rank, sig in enumerate(sigs):
        assert sig is not None
        diff = _first_difference(sig, ref)
        if diff is not None:
            raise ModelMismatchError(
                f"the model on rank {rank} differs from rank 0's ({len(sig)} vs {len(ref)} "
                f"parameters and buffers); first difference at {diff}. Build the same model "
                "on every rank before wrapping it")


def check_model_device(module: nn.Module, device: torch.device) -> None:
    """Raise :class:`ConfigError` naming both devices when a parameter or buffer of
    ``module`` is not on ``device`` (the one ``hexagram.init()`` chose).

    Example: a model left on the CPU under NCCL fails here, not inside a collective::

        hx.init(); model = hx.DistributedDataParallel(net.to(hx.get_runtime().device))
    """
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.device.type == "meta":
            continue  # deferred initialisation: materialised later by the user
        if t.device != device and not (t.device.type == device.type == "cpu"):
            raise ConfigError(
                f"{name!r} is on {t.device} but this rank communicates on {device} (the "
                f"device hexagram.init() chose); move the model first: "
                f"model.to(hexagram.get_runtime().device)")


def check_runs_on(module: nn.Module, device: torch.device) -> None:
    """Refuse layers that cannot run on ``device`` (the runtime's), naming the module.

    ``nn.SyncBatchNorm`` needs CUDA tensors and an NCCL group (PyTorch DDP refuses it with
    "SyncBatchNorm layers only work with GPU modules"); on the CPU it would fail only at
    the first forward pass.
    """
    if device.type == "cuda":
        return
    for name, m in module.named_modules():
        if isinstance(m, nn.SyncBatchNorm):
            raise ConfigError(
                f"SyncBatchNorm layers only work with GPU modules, and {name or 'the model'!r} "
                f"is one while this job runs on {device} (gloo). Use nn.BatchNorm on the CPU "
                "(convert back with a plain BatchNorm of the same shape), or run on CUDA "
                "with NCCL")


# -- non-finite gradients: once per step, on the device ----------------------------------
class FiniteGuard:
    """The engine's non-finite gradient check: at most one host read per step.

    For gradient algorithms whose reduction would not carry a NaN/Inf to every rank by
    itself (compressors, error feedback, robust aggregation), per step:

    1. :meth:`observe`, per bucket before the algorithm sees it: per-tensor sums (one pass;
       ``segment_reduce`` on CUDA) flag the tensors holding NaN/Inf, kept on the device;
       the bucket is then made finite in place (NaN/Inf -> 0, a second pass) so compressors
       and their residuals, momenta and warm starts stay finite;
    2. :meth:`agree`, after the last bucket was launched: where ranks must agree (``collective``
       is set: fp16 autocast, whose GradScalers must skip together, or
       ``on_nonfinite="skip"``), one tiny allreduce of "this rank saw a non-finite
       gradient" (device tensor, no host read: 8 bytes, counted in ``bytes_sent``);
       otherwise the flag stays this rank's, and no collective is added to the step;
    3. :meth:`poison`, per reduced bucket: where any rank saw one, the first element of
       every tensor becomes Inf on every rank (a few tiny kernels, no host read), so a
       ``torch.amp.GradScaler`` on every rank finds Inf, skips the same step and lowers its
       scale with the others; the optimizer never sees zeros;
    4. :meth:`check_step`, from the optimizer's step pre-hook (a GradScaler that found Inf
       never calls it): the one host read of the step. If some rank saw a non-finite
       gradient, ``on_nonfinite="raise"`` raises :class:`~hexagram.errors.
       NonFiniteGradientError` naming the step and this rank's first bad parameter (on
       every rank); ``"skip"`` zeroes the gradients and lets the optimizer step.

    A per-bucket sum of finite values that overflows float32 reads as non-finite (16-bit
    buckets are summed in float32); gradients never come near 3e38.

    Example (what the engine does; every call is collective-free but :meth:`agree`):
        >>> guard = FiniteGuard(buckets, comm)                    # doctest: +SKIP
        >>> guard.observe(bucket); handle = algorithm.bucket_ready(bucket)  # doctest: +SKIP
        >>> guard.agree(); guard.poison(bucket, handle.wait())     # doctest: +SKIP
        >>> guard.check_step(step=3, policy="raise")  # before optimizer.step  # doctest: +SKIP
    """

    def __init__(self, buckets: list[Bucket], comm: Communicator) -> None:
        self.comm = comm
        device = buckets[0].flat.device if buckets else torch.device("cpu")
        self._names = [e.name for b in buckets for e in b.entries]
        starts, first = [], 0
        for b in buckets:
            starts.append(first)
            first += len(b.entries)
        self._first = dict(zip((b.index for b in buckets), starts))
        # per bucket: tensor lengths (segment_reduce) and offsets (poison), on the device
        self._lengths = {b.index: torch.tensor([e.numel for e in b.entries], device=device)
                         for b in buckets}
        self._offsets = {b.index: torch.tensor([e.offset for e in b.entries], device=device)
                         for b in buckets}
        self._bad = torch.zeros(len(self._names), dtype=torch.bool, device=device)
        self.collective = False  # set per step by the engine (see step 2)
        self._any: Handle[Tensor] | None = None
        self._global: Tensor | None = None
        self._params = [e.param for b in buckets for e in b.entries]

    def observe(self, bucket: Bucket) -> None:
        """Step 1 for one bucket (call before the algorithm reads it)."""
        flat = bucket.flat
        wide = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
        with torch.no_grad():
            if flat.is_cuda:  # one kernel for every tensor of the bucket
                sums = torch.segment_reduce(wide, "sum", lengths=self._lengths[bucket.index])
            else:  # on the CPU a sum per tensor is 3x faster than segment_reduce
                sums = torch.stack([wide[e.offset:e.offset + e.numel].sum()
                                    for e in bucket.entries])
            first = self._first[bucket.index]
            self._bad[first:first + len(bucket.entries)] = ~torch.isfinite(sums)
            torch.nan_to_num_(flat, nan=0.0, posinf=0.0, neginf=0.0)

    def agree(self) -> None:
        """Step 2 (collective): start the sum over ranks of "saw a non-finite gradient"."""
        local = self._bad.any().to(CONTROL_DTYPE).reshape(1)
        self._any = primitives.allreduce(self.comm, local, average=False) \
            if self.collective else Handle.completed(local, "nonfinite")
        self._global = None

    def _flag(self) -> Tensor | None:
        if self._any is None:
            return None
        if self._global is None:
            self._global = self._any.wait()
        return self._global

    def poison(self, bucket: Bucket, result: Tensor) -> None:
        """Step 3: ``result`` (the bucket's reduced gradient, 1-D, the engine's buffer) gets
        Inf as the first element of each tensor where any rank saw a non-finite gradient."""
        flag = self._flag()
        if flag is None:
            return
        with torch.no_grad():
            idx = self._offsets[bucket.index]
            firsts = result.index_select(0, idx)
            inf = torch.full_like(firsts, float("inf"))
            result.index_copy_(0, idx, torch.where(flag > 0, inf, firsts))

    def poison_grads(self, bucket: Bucket, skip: frozenset[str]) -> None:
        """Step 3 where the ``.grad`` tensors are not views of the bucket (one tiny kernel
        per tensor)."""
        flag = self._flag()
        if flag is None:
            return
        with torch.no_grad():
            for e in bucket.entries:
                grad = e.param.grad
                if e.name in skip or grad is None:
                    continue
                first = grad.view(-1)[:1]
                first.copy_(torch.where(flag > 0, torch.full_like(first, float("inf")), first))

    def drop(self) -> None:
        """Forget this step's flag unread (a ``GradScaler`` handles the overflow: the
        reduced gradients already hold Inf, see :meth:`poison`)."""
        self._any = self._global = None

    def check_step(self, step: int, policy: str, checks: StepChecks | None = None) -> bool:
        """Step 4: True when the gradients were non-finite on some rank (``"skip"``: they
        are now zero); raises under ``"raise"``. Call once, before the optimizer step.
        ``checks`` (the algorithm's queued conditions, e.g. fp16's range) join the same
        host read; one of them that holds raises its own explanation."""
        if self._any is None:
            problem = checks.read() if checks is not None else None
            if problem:
                raise NonFiniteGradientError(problem)
            return False
        count = self._global if self._global is not None else self._any.wait()
        self._any = self._global = None
        seen = (count > 0).reshape(())
        problem = checks.read(also=seen) if checks is not None else \
            ("" if bool(seen) else None)  # the one host read of the step
        if problem is None:
            return False
        if problem:  # an algorithm's own condition (the gradients may be finite)
            raise NonFiniteGradientError(problem)
        bad = [self._names[i] for i in self._bad.nonzero().flatten().tolist()]
        if policy == "skip":
            for p in self._params:
                if p.grad is not None:
                    p.grad.zero_()
            return True
        where = f"parameter '{bad[0]}'" if bad else f"another rank ({int(count.item())} of " \
            f"{self.comm.size} ranks)"
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN or Inf) at step {step}: {where}, detected before "
            "compression. Lower the learning rate, clip gradients or use loss scaling "
            "(torch.amp.GradScaler skips such steps on every rank); or pass "
            "on_nonfinite='skip' to the algorithm to skip them")


def read_step_checks(guard: FiniteGuard | None, checks: StepChecks, step: int, policy: str,
                     scaler_handles_overflow: bool = False) -> bool:
    """The step's one host read: the engine's non-finite flag (``guard``, None where the
    algorithm's reduction carries NaN/Inf itself) and the algorithm's queued ``checks``.

    Called from the optimizer's step pre-hook, or, where the wrapper hooks no optimizer
    (gradient algorithms may be wrapped without ``optimizers=``), at the end of backward.
    There ``scaler_handles_overflow`` (the forward ran under fp16 autocast) drops the
    guard's flag unread: a ``GradScaler`` finds the Inf :meth:`FiniteGuard.poison` left and
    skips the step, as it skips the optimizer's pre-hook when hooked. True when the step's
    gradients were non-finite and ``policy="skip"`` zeroed them; raises
    :class:`~hexagram.errors.NonFiniteGradientError` (naming the step and the parameter)
    under ``"raise"`` or when an algorithm's condition holds.

    Example: ``read_step_checks(reducer.guard, ctx.checks, step=3, policy="raise")``.
    """
    if guard is not None and not scaler_handles_overflow:
        return guard.check_step(step, policy, checks)
    if guard is not None:
        guard.drop()
    problem = checks.read()  # the algorithm's own conditions (fp16 range of a cast)
    if problem:
        raise NonFiniteGradientError(problem)
    return False


# -- mixed precision for weight algorithms ----------------------------------------------
def fp16_autocast(device_type: str) -> bool:
    """True inside ``torch.autocast(device_type, dtype=torch.float16)``: the forward of a
    mixed-precision step whose loss a ``GradScaler`` scales."""
    return torch.is_autocast_enabled(device_type) and \
        torch.get_autocast_dtype(device_type) == torch.float16


def agree_finite_grads(comm: Communicator, params: list[nn.Parameter]) -> None:
    """Collective: where any rank's gradients of ``params`` hold NaN/Inf, every rank's do.

    For weight algorithms under fp16 autocast: each rank's ``GradScaler`` reads only its own
    gradients, so an overflow on one rank would make it alone skip ``optimizer.step()`` and
    its step hooks (local SGD's rounds, DiLoCo's outer steps, the decentralized exchange,
    momentum takeover) would fall out of step with its peers. One tiny allreduce at the end
    of backward, then Inf in the first element of every gradient (no host read): every
    scaler skips the same step and lowers its scale with the others.
    """
    grads = [p.grad for p in params if p.grad is not None]
    with torch.no_grad():
        if grads:
            sums = torch.stack([g.sum(dtype=torch.float32) for g in grads])
            local = (~torch.isfinite(sums)).any().to(CONTROL_DTYPE).reshape(1)
        else:
            local = torch.zeros(1, dtype=CONTROL_DTYPE, device=comm.device)
        total = primitives.allreduce(comm, local, average=False).wait()
        for g in grads:
            first = g.view(-1)[:1]
            first.copy_(torch.where(total > 0, torch.full_like(first, float("inf")), first))


def at_end_of_backward(output: Any, callback: Callable[[], None]) -> bool:
    """Run ``callback`` once at the end of the backward pass that goes through ``output``
    (a tensor or a structure of them); False when no output tensor requires grad."""
    for leaf in tree_leaves(output):
        if isinstance(leaf, Tensor) and leaf.requires_grad:
            def queue(grad: Tensor) -> Tensor:
                torch.autograd.Variable._execution_engine.queue_callback(callback)
                return grad
            leaf.register_hook(queue)
            return True
    return False
