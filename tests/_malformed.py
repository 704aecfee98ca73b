"""The worker side of the 2-rank malformed-payload tests (``test_malformed_payload_2rank``,
``test_malformed_weights_2rank``): the same small model wrapped on every rank, rank 1's
bytes corrupted from step :data:`BAD_STEP` on, and the outcome of a few training steps.

Example (in a ``run_local`` worker)::

    run = wrap("topk", {"density": 0.1})
    armed = [False]
    if run.rank == 1:
        corrupt_buffers(lambda p: replace(p, tensors=...), armed)
    return train(run, armed, STEPS)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

BAD_STEP = 2
STEPS = 5


@dataclass
class Run:
    """One rank's wrapped model: its rank, the plain module, optimizer and wrapper."""

    rank: int
    net: nn.Module
    opt: torch.optim.Optimizer
    model: Any  # hexagram.DistributedDataParallel


def wrap(algorithm: str, config: dict[str, Any], bucket_size_mb: float = 25.0) -> Run:
    """Join the job and wrap the same model (16 -> 32 -> 4, SGD lr 0.05) on every rank
    with ``hexagram.algorithms.get(algorithm, **config)``."""
    import hexagram as hx

    hx.init()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(algorithm, **config),
                                       bucket_size_mb=bucket_size_mb)
    return Run(hx.get_runtime().rank, net, opt, model)


def corrupt_buffers(corrupt: Callable[[Any], Any], armed: list[bool]) -> None:
    """Every payload this process packs for a collective is ``corrupt(payload)`` once
    ``armed[0]`` holds (its own error-feedback residuals see the honest payload, as with
    bytes corrupted in transit)."""
    from hexagram.compress.base import Payload

    honest = Payload.to_buffer

    def to_buffer(self: Payload) -> torch.Tensor:
        return honest(corrupt(self) if armed[0] else self)

    Payload.to_buffer = to_buffer  # type: ignore[method-assign]


def train(run: Run, armed: list[bool], steps: int = STEPS,
          after_step: Callable[[int], None] | None = None,
          synchronize: bool = False) -> dict[str, Any]:
    """Train ``steps`` steps (``armed[0]`` from :data:`BAD_STEP` on; ``after_step(step)``
    after each), then ``synchronize()`` if asked; the outcome: ``rank``, ``error`` (the
    :class:`~hexagram.errors.HexagramError`'s kind and message, a raw torch error marked
    "raw"), ``step`` (the one that raised) and ``finite`` (the weights)."""
    from hexagram.errors import HexagramError

    gen = torch.Generator().manual_seed(run.rank)
    outcome: dict[str, Any] = {"rank": run.rank, "error": None, "step": None}
    try:
        for step in range(steps):
            armed[0] = step >= BAD_STEP
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            outcome["step"] = step
            nn.functional.cross_entropy(run.model(x), y).backward()
            run.opt.step()
            run.opt.zero_grad()
            if after_step is not None:
                after_step(step)
        if synchronize:
            run.model.synchronize()
    except HexagramError as exc:
        outcome["error"] = (type(exc).__name__, str(exc))
    except Exception as exc:  # a raw torch error is a failure of the test
        outcome["error"] = ("raw " + type(exc).__name__, str(exc))
    outcome["finite"] = all(bool(torch.isfinite(p).all()) for p in run.net.parameters())
    try:
        run.model.close()
    except HexagramError:
        pass
    return outcome
