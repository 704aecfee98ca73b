"""The per-step non-finite gradient check, on the device: no host read but the step's one.

:class:`FiniteGuard` is the engine's check for gradient algorithms whose reduction would not
carry a NaN/Inf to every rank by itself; :func:`agree_finite_grads` is the collective
variant for weight algorithms under fp16 autocast; :func:`read_step_checks` is the step's
one host read. Every call issues a number of kernels that does not grow with the number of
tensors in a bucket (``torch._foreach_*`` over views cached per bucket, stacked flags).

Example:
    >>> import torch
    >>> bool(any_nonfinite([torch.ones(2), torch.tensor([1.0, float("nan")])]))
    True
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hexagram.algorithms.finite import StepChecks
from hexagram.buckets import Bucket
from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.device import CONTROL_DTYPE
from hexagram.compress import kernels
from hexagram.errors import NonFiniteGradientError, received, step_error

__all__ = ["FiniteGuard", "agree_finite_grads", "any_nonfinite", "read_step_checks"]


def _norms(tensors: list[Tensor]) -> list[Tensor]:
    """Per-tensor L2 norms of same-dtype ``tensors``, accumulated in float32 for 16-bit
    inputs (no widened copy; a large finite fp16 gradient stays finite), in their own
    dtype otherwise. One multi-tensor kernel per ~hundred tensors on CUDA, no host read.

    A norm is non-finite exactly when its tensor holds a NaN/Inf, except that a float32
    (or bfloat16) element above about 1.8e19 in magnitude squares past float32's range
    and reads as non-finite too; gradients never come near it (fp16 ones cannot)."""
    wide = torch.float32 if tensors[0].dtype in (torch.float16, torch.bfloat16) else None
    return list(torch._foreach_norm(tensors, 2, dtype=wide))


def any_nonfinite(tensors: list[Tensor]) -> Tensor:
    """0-d bool on the tensors' device: True where any of ``tensors`` holds NaN or Inf.

    Tensors of several dtypes are checked one dtype at a time (a few kernels per dtype,
    none per tensor); no host read."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    finite = [torch.stack(_norms(same)).lt(float("inf")).all() for same in by_dtype.values()]
    return (finite[0] if len(finite) == 1 else torch.stack(finite).all()).logical_not()


def _poison_firsts(tensors: list[Tensor], addend: Tensor) -> None:
    """Add ``addend`` (a 0-d tensor: +Inf where some rank saw a non-finite gradient, else
    0, which leaves a finite value as it is) to the first element of each tensor: one
    multi-tensor kernel, the flag never read on the host. Views only (no kernels) per
    tensor."""
    firsts = [t.view(-1)[:1] for t in tensors if t.numel() > 0]
    if firsts:  # the Tensor overload by name: torch._foreach_add_ would take a 0-d tensor
        # as a Python scalar (an .item(), a sync on CUDA)
        torch.ops.aten._foreach_add_.Tensor(firsts, addend)


def _segments(bucket: Bucket) -> list[Tensor]:
    """One 1-D view of ``bucket.flat`` per tensor, in bucket order."""
    return [bucket.flat[e.offset:e.offset + e.numel] for e in bucket.entries]


def _inf_where(flag: Tensor, dtype: torch.dtype) -> Tensor:
    """0-d ``dtype`` tensor: +Inf where ``flag`` (a 1-element count) > 0, else 0."""
    return torch.where(flag > 0, float("inf"), 0.0).to(dtype).reshape(())


class FiniteGuard:
    """The engine's non-finite gradient check: at most one host read per step.

    For gradient algorithms whose reduction would not carry a NaN/Inf to every rank by
    itself (compressors, error feedback, robust aggregation), per step:

    1. :meth:`observe`, per bucket before the algorithm sees it: the per-tensor L2 norms
       (``torch._foreach_norm`` over views of the bucket cached at construction,
       accumulated in float32 for 16-bit buckets without a widened copy; see
       :func:`_norms` for the one overflow caveat) flag the tensors holding NaN/Inf, kept
       on the device: 5 aten ops per bucket whatever its number of tensors, no host read
       (``segment_reduce``, which this replaces, read its lengths on the host twice per
       bucket and summed each tensor on one SM). Then the bucket is made finite in place
       (NaN/Inf -> 0: ``nan_to_num_``, one more memory-bound pass, about twice the bucket's
       bytes of traffic). The cleaning stays on every step on purpose: a GradScaler
       overflow never reaches the host read of :meth:`check_step` (the scaler skips the
       optimizer step, and with it the read), so only an unconditional pass keeps
       error-feedback residuals, PowerSGD's warm start and momenta finite without a sync;
    2. :meth:`agree`, after the last bucket was launched: where ranks must agree
       (``collective`` is set: fp16 autocast, whose GradScalers must skip together, or
       ``on_nonfinite="skip"``), one tiny allreduce of "this rank saw a non-finite
       gradient" (device tensor, no host read: 8 bytes, counted in ``bytes_sent``);
       otherwise the flag stays this rank's, and no collective is added to the step;
    3. :meth:`poison`, per reduced bucket: where any rank saw one, the first element of
       every tensor becomes Inf on every rank (3 kernels per bucket, no host read), so a
       ``torch.amp.GradScaler`` on every rank finds Inf, skips the same step and lowers
       its scale with the others; the optimizer never sees zeros;
    4. :meth:`check_step`, from the optimizer's step pre-hook (a GradScaler that found Inf
       never calls it): the one host read of the step. If some rank saw a non-finite
       gradient, ``on_nonfinite="raise"`` raises :class:`~hexagram.errors.
       NonFiniteGradientError` naming the step and this rank's first bad parameter (on
       every rank); ``"skip"`` zeroes the gradients and lets the optimizer step.

    Example (what the engine does; every call is collective-free but :meth:`agree`):
        >>> guard = FiniteGuard(buckets, comm)                    # doctest: +SKIP
        >>> guard.observe(bucket); handle = algorithm.bucket_ready(bucket)  # doctest: +SKIP
        >>> guard.agree(); guard.poison(bucket, handle.wait())     # doctest: +SKIP
        >>> guard.check_step(step=3, policy="raise")  # before optimizer.step  # doctest: +SKIP
    """

    def __init__(self, buckets: list[Bucket], comm: Communicator, local: bool = True) -> None:
        self.comm = comm
        #: False for an algorithm whose reduction carries a NaN/Inf to every rank itself
        #: (allreduce): the engine then skips steps 1-3 and checks only what arrives (3a)
        self.local = local
        device = buckets[0].flat.device if buckets else torch.device("cpu")
        self._names = [e.name for b in buckets for e in b.entries]
        self._bad = torch.zeros(len(self._names), dtype=torch.bool, device=device)
        # per bucket (by index): its buffer, a view of it per tensor, and this bucket's
        # slice of _bad, made once (each slice or view is an aten op if made per step)
        self._views: dict[int, tuple[Tensor, list[Tensor], Tensor]] = {}
        first = 0
        for b in buckets:
            end = first + len(b.entries)
            self._views[b.index] = (b.flat, _segments(b), self._bad[first:end])
            first = end
        self._offsets = {b.index: torch.tensor([e.offset for e in b.entries], device=device)
                         for b in buckets}
        #: kept for callers that set it per step (fp16 autocast, ``"skip"``); with more
        #: than one rank the flag is shared whatever its value (see :meth:`agree`)
        self.collective = False
        self._arrived: list[Tensor] = []  # per reduced bucket: its min and max (step 3a)
        self._any: Handle[Tensor] | None = None
        self._global: Tensor | None = None
        self._addend: dict[torch.dtype, Tensor] = {}  # this step's Inf-or-0, per dtype
        self._params = [e.param for b in buckets for e in b.entries]

    def _bucket_views(self, bucket: Bucket) -> tuple[list[Tensor], Tensor]:
        flat, views, bad = self._views[bucket.index]
        if flat is not bucket.flat:  # another buffer with this layout: view it instead
            views = _segments(bucket)
            self._views[bucket.index] = (bucket.flat, views, bad)
        return views, bad

    def observe(self, bucket: Bucket) -> None:
        """Step 1 for one bucket (call before the algorithm reads it).

        Where the fused kernels take the bucket (CUDA, :func:`kernels.dispatch`), one
        kernel reads it once, flags the tensors that hold a NaN/Inf (only those: no
        overflow caveat) and writes zeros over them alone
        (:func:`kernels.finite_clean`); elsewhere the norms and ``nan_to_num_`` below."""
        views, bad = self._bucket_views(bucket)
        starts = self._offsets[bucket.index]
        if 0 < starts.numel() <= bucket.flat.numel() and kernels.dispatch(bucket.flat, bad,
                                                                           starts):
            with torch.no_grad():
                kernels.finite_clean(bucket.flat, starts, out=bad)
            return
        with torch.no_grad():
            # a norm is >= 0, Inf or NaN: "not below Inf" flags both (isfinite: 4 kernels)
            torch.lt(torch.stack(_norms(views)), float("inf"), out=bad).logical_not_()
            torch.nan_to_num_(bucket.flat, nan=0.0, posinf=0.0, neginf=0.0)

    def flagged(self) -> list[str]:
        """Names of this rank's tensors that held NaN/Inf in the step observed so far, in
        bucket order. A host read: for :meth:`check_step`'s message and diagnostics,
        never on the hot path."""
        return [self._names[i] for i in self._bad.nonzero().flatten().tolist()]

    def agree(self) -> None:
        """Step 2 (collective with more than one rank): start the sum over ranks of "saw a
        non-finite gradient". Always shared, autocast or not: a ``GradScaler`` used without
        fp16 autocast (bf16, fp32) must skip on every rank or on none, and ``"raise"`` must
        stop every rank at the same step (a flag kept local let the rank that saw the NaN
        skip or raise alone)."""
        self.drop()
        if not self.local:
            return  # nothing observed, nothing to share: only what arrives is checked
        local = self._bad.any().to(CONTROL_DTYPE).reshape(1)
        self._any = primitives.allreduce(self.comm, local, average=False) \
            if self.collective or self.comm.size > 1 else Handle.completed(local, "nonfinite")

    def arrived(self, result: Tensor) -> None:
        """Step 3a, per reduced bucket: queue whether ``result`` (what arrived: the bucket's
        gradient after reduction and decoding) holds NaN/Inf. One read-only pass
        (``aminmax``), no host read: the flags join :meth:`check_step`'s one read. Every
        rank decodes the same bytes, so every rank sees the same flag: a peer's NaN (an
        attacker past its own guard, a corrupted payload) stops or skips every rank at
        the same step instead of reaching the optimizers."""
        if result.numel():
            self._arrived.extend(torch.aminmax(result.detach().reshape(-1)))

    def _arrival_bad(self) -> Tensor | None:
        """0-d bool: some reduced bucket of this step held NaN/Inf (None: none checked)."""
        if not self._arrived:
            return None
        lows_highs = torch.stack([t.float() for t in self._arrived]) \
            if len({t.dtype for t in self._arrived}) > 1 else torch.stack(self._arrived)
        return torch.isfinite(lows_highs).all().logical_not()

    def _flag(self) -> Tensor | None:
        if self._any is None:
            return None
        if self._global is None:
            self._global = self._any.wait()
        return self._global

    def _inf_or_zero(self, dtype: torch.dtype) -> Tensor | None:
        """This step's 0-d Inf-or-0 of ``dtype`` (made once per step and dtype)."""
        flag = self._flag()
        if flag is None:
            return None
        if dtype not in self._addend:
            self._addend[dtype] = _inf_where(flag, dtype)
        return self._addend[dtype]

    def poison(self, bucket: Bucket, result: Tensor) -> None:
        """Step 3: ``result`` (the bucket's reduced gradient, 1-D, the engine's buffer) gets
        Inf as the first element of each tensor where any rank saw a non-finite gradient."""
        addend = self._inf_or_zero(result.dtype)
        if addend is None:
            return
        with torch.no_grad():
            idx = self._offsets[bucket.index]
            result.index_copy_(0, idx, result.index_select(0, idx).add_(addend))

    def poison_grads(self, bucket: Bucket, skip: frozenset[str]) -> None:
        """Step 3 where the ``.grad`` tensors are not views of the bucket: one multi-tensor
        kernel over their first elements."""
        addend = self._inf_or_zero(bucket.dtype)
        if addend is None:
            return
        grads = [e.param.grad for e in bucket.entries if e.name not in skip]
        with torch.no_grad():
            _poison_firsts([g for g in grads if g is not None], addend)

    def drop(self) -> None:
        """Forget this step's flags unread (a ``GradScaler`` handles the overflow: the
        reduced gradients already hold Inf, see :meth:`poison`)."""
        self._any = self._global = None
        self._addend = {}
        self._arrived = []

    def check_step(self, step: int, policy: str, checks: StepChecks | None = None) -> bool:
        """Step 4: True when the gradients were non-finite on some rank or arrived
        non-finite (``"skip"``: they are now zero); raises under ``"raise"``. Call once,
        before the optimizer step. ``checks`` (the algorithm's queued conditions, e.g.
        fp16's range) join the same host read; one of them that holds raises its own
        explanation, except a problem with what arrived (a peer's malformed payload, a
        non-finite sum) under ``"skip"``, which skips the
        step on every rank like a non-finite one. Every rank reaches the same decision:
        the count is summed over ranks, and every rank decoded the same bytes."""
        arrived = self._arrival_bad()
        count = None if self._any is None else \
            self._global if self._global is not None else self._any.wait()
        self.drop()
        seen = arrived if count is None else (count > 0).reshape(())
        if seen is not None and count is not None and arrived is not None:
            seen = seen | arrived
        if checks is not None:
            problem = checks.read(also=seen)  # the one host read of the step
        else:
            problem = None if seen is None or not bool(seen) else ""
        if problem is None:
            return False
        if problem and not (policy == "skip" and received(problem)):
            raise step_error(problem)  # an algorithm's own condition (fp16's range...)
        if policy == "skip":  # non-finite, or a peer's malformed payload: every rank skips
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)
            return True
        raise NonFiniteGradientError(self._explain(step, count))

    def _explain(self, step: int, count: Tensor | None) -> str:
        """The error of a non-finite step (runs only on a failure: reads freely)."""
        fix = ("Lower the learning rate, clip gradients or use loss scaling "
               "(torch.amp.GradScaler skips such steps on every rank); or pass "
               "on_nonfinite='skip' to the algorithm to skip them")
        bad = self.flagged()
        ranks = 0 if count is None else int(count.item())
        if bad or ranks:
            where = f"parameter '{bad[0]}'" if bad else \
                f"another rank ({ranks} of {self.comm.size} ranks)"
            return (f"non-finite gradient (NaN or Inf) at step {step}: {where}, detected "
                    f"before compression. {fix}")
        if not self.local:  # a sum: no rank's own gradient was looked at before it
            where = next((f"parameter '{n}'" for n, p in zip(self._names, self._params)
                          if p.grad is not None and not bool(p.grad.isfinite().all())),
                         "the reduced gradient")
            return (f"non-finite gradient (NaN or Inf) at step {step}: {where} holds NaN/Inf "
                    "after the reduction over the ranks (a sum: some rank's gradient held "
                    "NaN or Inf, or its contribution arrived corrupted; a robust "
                    f"aggregate: every rank's contribution did). {fix}")
        return (f"non-finite gradient (NaN or Inf) at step {step}: the reduced gradient "
                "holds NaN/Inf although no rank's own gradient did, so a peer's "
                "contribution arrived non-finite or malformed (a faulty or Byzantine "
                "rank, or a corrupted payload). Use algorithm='robust' to exclude such "
                "contributions and train on, or on_nonfinite='skip' to skip such steps")


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
        raise step_error(problem)
    return False


def agree_finite_grads(comm: Communicator, params: list[nn.Parameter]) -> None:
    """Collective: where any rank's gradients of ``params`` hold NaN/Inf, every rank's do.

    For weight algorithms under fp16 autocast: each rank's ``GradScaler`` reads only its own
    gradients, so an overflow on one rank would make it alone skip ``optimizer.step()`` and
    its step hooks (local SGD's rounds, DiLoCo's outer steps, the decentralized exchange,
    momentum takeover) would fall out of step with its peers. One tiny allreduce at the end
    of backward, then Inf in the first element of every gradient (multi-tensor kernels, no
    host read): every scaler skips the same step and lowers its scale with the others.
    """
    grads = [p.grad for p in params if p.grad is not None]
    with torch.no_grad():
        if grads:
            local = any_nonfinite(grads).to(CONTROL_DTYPE).reshape(1)
        else:
            local = torch.zeros(1, dtype=CONTROL_DTYPE, device=comm.device)
        total = primitives.allreduce(comm, local, average=False).wait()
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, same in by_dtype.items():
            _poison_firsts(same, _inf_where(total, dtype))
