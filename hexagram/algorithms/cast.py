"""16-bit casting around a gradient algorithm: ``get(name, cast="fp16")`` (or ``"bf16"``).

Every bucket is cast to 16 bits, the wrapped algorithm reduces that copy (its payloads,
factors and error-feedback residuals are then 16-bit too), and the result is cast back into
the bucket: PyTorch's ``fp16_compress_wrapper`` for any Hexagram gradient algorithm. What
it saves is the wrapped algorithm's own float payload: half of PowerSGD's factors, of
top-k's values, of allreduce's buffer (``cast="fp16"`` around ``allreduce`` sends as many
bytes as the ``fp16`` algorithm, which divides by P before casting and so rounds
differently). Payloads that are not floats (sign bits, quantized
levels, indices) do not shrink.

fp16's range ends at 65504: a bucket whose largest magnitude exceeds ``65504 / P`` (its sum
over P ranks could overflow) raises :class:`~hexagram.errors.NonFiniteGradientError` naming
the parameters at the end of backward (checked on the device, read once per step), as the
``fp16`` algorithm does; ``"bf16"`` has float32's range. The
algorithms whose protocol needs full precision are refused at wrap time
(:data:`INCOMPATIBLE`, each with its reason).

Example:
    >>> import hexagram as hx
    >>> type(hx.algorithms.get("powersgd", cast="bf16")).__name__
    'Cast'
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from hexagram.algorithms.base import Algorithm, Forwarding
from hexagram.algorithms.finite import StepChecks
from hexagram.buckets import Bucket
from hexagram.comm.communicator import Handle
from hexagram.errors import ConfigError, NonFiniteGradientError

__all__ = ["CASTS", "INCOMPATIBLE", "Cast", "check_cast", "check_fp16_range"]

#: wire name -> dtype
CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}

#: algorithms that refuse a cast, and why
INCOMPATIBLE = {
    "fp16": "it is 16-bit already (choose its wire='fp16' or 'bf16')",
    "auto": "it chooses among candidates itself; cast a fixed algorithm instead",
    "qadam": "its optimizer keeps float32 moments that the reduced gradient updates",
    "gtopk": "its merge rounds pack 32-bit indices after the values at 4-byte offsets",
}

_FP16_MAX = float(torch.finfo(torch.float16).max)


def check_fp16_range(tensor: Tensor, scale: float, what: str,
                     checks: StepChecks | None = None) -> None:
    """Raise :class:`NonFiniteGradientError` when ``tensor``'s largest finite magnitude
    times ``scale`` passes fp16's 65504 (NaN/Inf are left to the check of what arrives):
    ``1 / P`` where values are divided by the world size before the cast (the ``fp16``
    algorithm), ``P`` where P of them are summed in fp16 (the cast wrapper). ``what`` opens
    the message. With ``checks`` nothing is read: the condition is queued there, and raised
    when the step's checks are read."""
    lo, hi = torch.aminmax(tensor)  # one pass, no |x| temporary
    peak = torch.maximum(-lo, hi)
    if checks is not None:
        # a finite value that the cast would turn into Inf; a NaN/Inf already there is not
        # a range problem: the sum carries it to every rank, whose check of what arrives
        # (or GradScaler) sees it at the same step
        past = (peak.double() * scale > _FP16_MAX).logical_and_(peak.isfinite())
        checks.add(past, lambda: _range_message(what, float(peak), scale))
        return
    if math.isfinite(float(peak)) and float(peak) * scale > _FP16_MAX:
        raise NonFiniteGradientError(_range_message(what, float(peak), scale))


def _range_message(what: str, peak: float, scale: float) -> str:
    return (f"{what} reaches {peak:.3g}, x {scale:.3g} on the wire passes fp16's "
            f"{_FP16_MAX:.0f} and would become Inf. Use bf16 or clip gradients")


def check_cast(algorithm: Algorithm, cast: Any) -> torch.dtype | None:
    """The dtype ``cast`` asks for (None for no cast), or a clear :class:`ConfigError`."""
    if cast is None or cast is False:
        return None
    if cast not in CASTS:
        raise ConfigError(f"algorithm {algorithm.name!r}: cast must be one of "
                          f"{', '.join(map(repr, CASTS))} or None, got {cast!r}")
    if algorithm.kind != "grad":
        raise ConfigError(f"algorithm {algorithm.name!r}: cast wraps gradient algorithms; "
                          f"{algorithm.name!r} communicates {algorithm.kind}s")
    if algorithm.name in INCOMPATIBLE:
        raise ConfigError(f"algorithm {algorithm.name!r} cannot be cast to {cast}: "
                          f"{INCOMPATIBLE[algorithm.name]}")
    return CASTS[cast]


class Cast(Forwarding):
    """``inner`` run on a 16-bit copy of every bucket; see the module docstring."""

    name = "cast"
    kind = "grad"

    def __init__(self, inner: Algorithm, dtype: torch.dtype) -> None:
        super().__init__(inner)
        self.dtype = dtype

    def bucket_ready(self, bucket: Bucket) -> Handle[Tensor] | None:
        if bucket.dtype == self.dtype or not bucket.dtype.is_floating_point:
            return self.inner.bucket_ready(bucket)
        if self.dtype == torch.float16:
            check_fp16_range(bucket.flat, self.ctx.comm.size,
                             f"cast='fp16' around {self.inner.name!r}: gradient of "
                             f"{', '.join(bucket.names)}", self.ctx.checks)
        low = bucket.over(bucket.flat.to(self.dtype))
        handle = self.inner.bucket_ready(low) or Handle.completed(low.flat)
        # the result may be the 16-bit buffer or one of the algorithm's own
        return handle.then(lambda result: bucket.flat.copy_(result))

    def after_backward(self) -> None:
        self.inner.after_backward()  # a compressed algorithm reads the step's checks
        problem = self.ctx.checks.due()  # the range checks, where the inner reads none
        if problem is not None:
            raise NonFiniteGradientError(problem)
