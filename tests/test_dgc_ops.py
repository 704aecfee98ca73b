"""DGC with every option on adds no per-tensor ops to a step.

``tests/test_step_ops.py`` counts DGC's default (no clipping, no masking, no momentum to
take over). Here the same count (``benchmarks/step_ops.py``'s counter: two steady steps of
a world-1 model of 128 parameter tensors in one bucket, less the plain model's two steps)
runs with local clipping, momentum factor masking, the SGD momentum and weight decay taken
over (two optimizer groups: two momenta) and a sparsity warm-up still under way in the
counted steps: each of them is whole-buffer work, so the wrapper stays within the same
400-op margin over the plain model. Per tensor it made about 6,500 (clipping's, masking's
and the momentum update's slices, views and scatters).
"""

from __future__ import annotations

import collections
import contextlib
import warnings

import step_ops  # benchmarks/ (tests/conftest.py puts it on the path)
import torch

import hexagram as hx
from hexagram.launch import run_local

MARGIN = 400  # as tests/test_step_ops.py
WARMUP, COUNTED = 3, 2
CONFIG = {"density": 0.01, "clip_norm": 1.0, "masking": True, "warmup_steps": 8}


def _optimizer(net: torch.nn.Module) -> torch.optim.SGD:
    params = list(net.parameters())
    return torch.optim.SGD([{"params": params[:2], "momentum": 0.5},
                            {"params": params[2:]}], lr=0.01, momentum=0.9,
                           weight_decay=1e-4)


def _count(wrap: bool) -> collections.Counter[str]:
    """Ops of the counted steps, wrapped in DGC (``CONFIG``) or plain."""
    net = step_ops._model()
    opt = _optimizer(net)
    model: torch.nn.Module = net
    if wrap:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the momentum taken over is warned
            model = hx.DistributedDataParallel(
                net, optimizers=[opt], algorithm=hx.algorithms.get("dgc", **CONFIG),
                bucket_size_mb=step_ops.HUGE_MB, first_bucket_mb=step_ops.HUGE_MB)
        assert len(model.buckets) == 1
    gen = torch.Generator().manual_seed(1)
    counter = step_ops.OpCounter()
    for step in range(WARMUP + COUNTED):
        x = torch.randn(step_ops.BATCH, step_ops.WIDTH, generator=gen)
        with counter.counting() if step >= WARMUP else contextlib.nullcontext():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    if wrap:
        algo = model.algorithm
        assert algo.density_at(algo.step - 1) > CONFIG["density"]  # still warming up
        model.close()
    return counter.ops


def _worker() -> tuple[int, int, list[tuple[str, int]]]:
    hx.init(backend="gloo")
    wrapped, plain = _count(True), _count(False)
    return wrapped.total(), plain.total(), (wrapped - plain).most_common(6)


def test_dgc_with_every_option_adds_no_per_tensor_ops() -> None:
    wrapped, plain, top = run_local(_worker, 1, timeout=240)[0]
    assert wrapped - plain <= MARGIN, (
        f"dgc {CONFIG} adds {wrapped - plain:,} ops to {COUNTED} steps of a model of "
        f"{2 * step_ops.LAYERS} tensors (allowed {MARGIN}); most added: {top}")
