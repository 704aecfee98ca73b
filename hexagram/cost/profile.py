"""Measured compute and compressor costs: what the step-time model reads besides the network.

- :class:`ComputeProfile`: forward time, when each gradient is ready in backward (seconds
  after backward started, in ready order), backward time, and the rest of the step
  (optimizer, data loading: everything from the end of backward to the next forward).
  :func:`profile_module` measures it locally (``hexagram advise --model``); ``auto``
  measures it in the job's own first steps; the lab's workers record the same figures.
- :class:`CompressorCost`: seconds to compress and to decompress, ``a + b * n`` for ``n``
  elements, fitted from two sizes on the job's device (:func:`measure_compressor`). On a
  CPU these are the thread's CPU seconds (:func:`device_clock`), so ranks that time them at
  once on shared cores do not inflate them; the model scales CPU by ranks per core.

Example:
    >>> cost = CompressorCost(compress=(1e-4, 2e-9), decompress=(5e-5, 1e-9))
    >>> round(cost.encode(1_000_000), 6), round(cost.decode(1_000_000), 6)
    (0.0021, 0.00105)
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from hexagram.compress.base import Compressor
from hexagram.cost.facts import TensorSpec, TreeCost
from hexagram.cost.fit import cost_line, line_through
from hexagram.cost.stopwatch import fastest

__all__ = ["CompressorCost", "ComputeProfile", "TreeCost", "cost_from_times", "device_clock",
           "measure_compressor", "profile_module"]


@dataclass
class ComputeProfile:
    """One training step's compute, without communication.

    Attributes:
        forward_s: forward pass (and loss) time.
        backward_s: from the start of backward to its end.
        update_s: from the end of backward to the next forward (optimizer step, data).
        tensors: the gradients in the order they become ready.
        ready_s: for each of ``tensors``, seconds after backward started.
        cpu_s: CPU seconds the step's compute takes on its thread (None: not measured);
            the model's CPU floor, where ranks share cores, starts from it.
    """

    forward_s: float
    backward_s: float
    update_s: float
    tensors: list[TensorSpec]
    ready_s: list[float]
    cpu_s: float | None = None

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.update_s

    def to_json(self) -> dict[str, Any]:
        return {"forward_s": self.forward_s, "backward_s": self.backward_s,
                "update_s": self.update_s, "ready_s": self.ready_s, "cpu_s": self.cpu_s,
                "tensors": [asdict(t) for t in self.tensors]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ComputeProfile:
        specs = [TensorSpec(t["name"], tuple(t["shape"]), t.get("itemsize", 4))
                 for t in data["tensors"]]
        return cls(data["forward_s"], data["backward_s"], data["update_s"], specs,
                   list(data["ready_s"]), data.get("cpu_s"))

    @classmethod
    def from_worker(cls, figures: dict[str, Any], shapes: Sequence[tuple[int, ...]] | None
                    = None) -> ComputeProfile:
        """From a lab worker's local-step figures (``compute_s``, ``backward_s``,
        ``ready_s`` and ``ready_numel`` per parameter in registration order): ready order
        is the sort by ready time; the forward is not separated there, so it counts in
        the time before the first gradient (``forward_s = 0``)."""
        ready, numel = figures["ready_s"], figures["ready_numel"]
        shapes = shapes or [(n,) for n in numel]
        order = sorted(range(len(ready)), key=lambda i: (ready[i], -i))
        specs = [TensorSpec(f"p{i}", tuple(shapes[i])) for i in order]
        return cls(0.0, figures["backward_s"], figures["compute_s"] - figures["backward_s"],
                   specs, [ready[i] for i in order], figures.get("compute_cpu_s"))


@dataclass(frozen=True)
class CompressorCost:
    """``(a, b)`` pairs: ``a + b * n`` seconds for ``n`` elements; ``tree``: the
    algorithm's own tree work where it has one (gTop-k), else None."""

    compress: tuple[float, float]
    decompress: tuple[float, float]
    tree: TreeCost | None = None

    def encode(self, n: int) -> float:
        return self.compress[0] + self.compress[1] * n

    def decode(self, n: int) -> float:
        return self.decompress[0] + self.decompress[1] * n


def device_clock(device: torch.device | str = "cpu") -> Callable[[], float]:
    """The clock compressor costs are read on: this thread's CPU time on a CPU (immune to
    other processes on the same cores: the model scales CPU by ranks per core itself);
    wall time after draining the stream on CUDA, where the work runs on the GPU.

    >>> clock = device_clock("cpu")
    >>> clock() >= 0.0
    True
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return time.thread_time

    def cuda_clock() -> float:
        torch.cuda.synchronize(dev)
        return time.perf_counter()
    return cuda_clock


def measure_compressor(compressor: Compressor, device: torch.device | str = "cpu",
                       sizes: tuple[tuple[int, ...], tuple[int, ...]] = ((32, 32),
                                                                        (512, 512)),
                       reps: int = 2, feedback: bool = False) -> CompressorCost:
    """Time ``compressor`` (a copy: its state stays as it is) on random float32 tensors
    of two shapes on ``device`` (:func:`device_clock`); the best of ``reps`` runs per
    shape. ``feedback``: the encode is error feedback's, as the algorithms run it
    (residual added in place, compressed, decoded locally, new residual written): two
    passes and a decode per element more than the bare compressor."""
    comp, clock = copy.deepcopy(compressor), device_clock(device)
    gen = torch.Generator(device=device).manual_seed(0)
    points: list[tuple[int, float, float]] = []
    for shape in sizes:
        x = torch.randn(*shape, generator=gen, device=device)
        payload = comp.compress(x, gen)
        encode = _feedback_encode(comp, x, gen)[0] if feedback else (
            lambda x=x: comp.compress(x, gen))
        enc = fastest(encode, reps, clock)[0]
        dec = fastest(lambda p=payload: comp.decompress(p), reps, clock)[0]  # type: ignore[misc]
        points.append((x.numel(), enc, dec))
    (n0, e0, d0), (n1, e1, d1) = points
    return CompressorCost(line_through(n0, e0, n1, e1), line_through(n0, d0, n1, d1))


def _feedback_encode(comp: Compressor, x: torch.Tensor, gen: torch.Generator
                     ) -> tuple[Callable[[], Any], Any]:
    """A function doing one error-feedback encode of a copy of ``x`` in place, as
    :meth:`hexagram.algorithms.compressed.CompressedAlgorithm.compress_with_feedback`,
    and its :class:`~hexagram.compress.ErrorFeedback` (a residual already held)."""
    from hexagram.compress.feedback import ErrorFeedback

    ef, buf = ErrorFeedback(comp), x.clone()
    ef.compress("x", x, gen)  # a residual to add from now on

    def encode() -> None:
        ef.correct_("x", buf)
        ef.update_from("x", buf, comp.compress(buf, gen))
    return encode, ef


def cost_from_times(points: Sequence[tuple[int, float, float]]) -> CompressorCost | None:
    """Least-squares ``a + b n`` of compress and decompress times from ``(n, compress s,
    decompress s)`` points (e.g. :func:`hexagram.cost.schedule.sizing_times`: the job's own
    tensor shapes); None without points."""
    if not points:
        return None
    if len({p[0] for p in points}) == 1:  # one size: all per element
        n = points[0][0]
        return CompressorCost((0.0, min(p[1] for p in points) / n),
                              (0.0, min(p[2] for p in points) / n))
    return CompressorCost(cost_line([(p[0], p[1]) for p in points]),
                          cost_line([(p[0], p[2]) for p in points]))


def profile_module(model: nn.Module, batch: Callable[[], tuple[Any, Any]],
                   loss: Callable[[Any, Any], torch.Tensor], steps: int = 3,
                   lr: float = 0.01) -> ComputeProfile:
    """Measure a local step of ``model`` (a copy, SGD with momentum), medians over
    ``steps`` after one warm-up step. ``batch()`` gives ``(x, y)``."""
    net = copy.deepcopy(model)
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for _, p in named], lr=lr, momentum=0.9)
    marks: dict[str, float] = {}
    hooks = [p.register_post_accumulate_grad_hook(_mark(marks, n)) for n, p in named]
    rows: list[tuple[float, float, float, dict[str, float]]] = []
    try:
        for _ in range(steps + 1):
            x, y = batch()
            marks.clear()
            t0 = time.perf_counter()
            out = loss(net(x), y)
            t1 = time.perf_counter()
            out.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            rows.append((t1 - t0, t2 - t1, t3 - t2, {n: m - t1 for n, m in marks.items()}))
    finally:
        for h in hooks:
            h.remove()
    rows = rows[1:]
    med = [statistics.median([r[0] for r in rows]), statistics.median([r[1] for r in rows]),
           statistics.median([r[2] for r in rows])]
    ready = {n: statistics.median(r[3].get(n, r[1]) for r in rows) for n, _ in named}
    order = sorted(named, key=lambda np_: ready[np_[0]])
    specs = [TensorSpec(n, tuple(p.shape), p.element_size()) for n, p in order]
    return ComputeProfile(med[0], med[1], med[2], specs, [ready[n] for n, _ in order])


def _mark(marks: dict[str, float], name: str) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        marks[name] = time.perf_counter()
    return hook
