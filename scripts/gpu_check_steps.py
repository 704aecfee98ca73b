"""Timed and profiled training steps for ``scripts/gpu_check.py`` (its ``model`` and
``profile`` parts), run on a world-1 rank.

A *setup* is one way of training the same model: ``no wrapper``, ``torch DDP``
(``torch.nn.parallel.DistributedDataParallel``) or a registered algorithm through
``hexagram.DistributedDataParallel``. Warm-ups are shortened so the timed steps are steady
(:data:`CONFIGS`; QAdam's optimizer freezes its variance after one step), the weight
algorithms run with period 4, ``decoupled_momentum`` takes SGD momentum 0.9 (it refuses an
optimizer without momentum). Workloads:

- ``mlp``: 6 x ``Linear(4096, 4096)`` (100.7M parameters), batch 32, SGD lr 1e-4;
- ``gpt2``: a Hugging Face GPT-2 (124M, built from ``GPT2Config()``; ``hexagram.models``
  has no GPT of that size), 8 x 512 tokens, bf16 autocast, AdamW (fused on CUDA); skipped,
  with the reason, where ``transformers`` is not importable.

Each worker gets a time budget: setups not started before it ends are reported as
skipped, so a slow machine returns partial tables rather than none. The same functions
run on a CPU rank with ``size="tiny"`` (small models, wall-clock timing, no CUDA
profile); ``tests/test_gpu_check_script.py`` runs them so.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["CONFIGS", "Workload", "algorithm", "gpt2_workload", "mlp_workload", "optimizer",
           "profile_setups", "time_models"]

#: algorithm -> config: warm-ups ended within the warm-up steps, weight algorithms at period 4
CONFIGS: dict[str, dict[str, Any]] = {
    "powersgd": {"start_iter": 1}, "local_sgd": {"period": 4}, "diloco": {"period": 4},
    "sparseloco": {"period": 4}, "robust": {"f": 0}, "auto": {"verbose": False}}
REFERENCES = ("no wrapper", "torch DDP")
WARMUP, TIMED, TOP = 3, 8, 8
MLP_SHARE = 0.35  # of a model worker's budget; the GPT-2 half gets the rest


def algorithm(name: str) -> Any:
    """``name``'s algorithm as the check runs it (:data:`CONFIGS`)."""
    import hexagram as hx

    return hx.algorithms.get(name, **CONFIGS.get(name, {}))


def optimizer(name: str, params: Any, kind: str = "sgd", lr: float = 1e-4
              ) -> torch.optim.Optimizer:
    """The optimizer setup ``name`` trains with: QAdam's own for ``qadam``, SGD momentum
    0.9 for ``decoupled_momentum``, else ``kind`` ("sgd" or "adamw", fused on CUDA)."""
    params = list(params)
    if name == "qadam":
        from hexagram.optim.qadam import QAdamOptimizer

        return QAdamOptimizer(params, lr=lr, warmup_steps=1)
    if name == "decoupled_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, fused=params[0].is_cuda)
    return torch.optim.SGD(params, lr=lr)


@dataclass(frozen=True)
class Workload:
    """A model, its batch, its loss and how it is trained."""

    title: str
    build: Callable[[], nn.Module]
    batch: Any
    loss: Callable[[nn.Module, Any], Tensor]
    optimizer: str = "sgd"
    autocast: torch.dtype | None = None


def mlp_workload(device: torch.device, size: str = "full") -> Workload:
    """6 x Linear(4096, 4096) (100.7M parameters), batch 32; ``tiny``: width 64, batch 4."""
    width, batch = (4096, 32) if size == "full" else (64, 4)

    def build() -> nn.Module:
        torch.manual_seed(0)
        with device:  # initialised where it trains
            return nn.Sequential(*[nn.Linear(width, width) for _ in range(6)])

    x = torch.randn(batch, width, device=device)
    params = 6 * (width * width + width)
    return Workload(f"MLP 6 x Linear({width}, {width}), {params / 1e6:.1f}M parameters, "
                    f"batch {batch}, SGD", build, x, lambda m, b: m(b).square().mean())


def gpt2_workload(device: torch.device, size: str = "full") -> Workload | str:
    """Hugging Face GPT-2 124M, 8 x 512 tokens, bf16 autocast, AdamW; a reason if absent."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:
        return (f"skipped: transformers is not importable ({exc}); hexagram.models has no "
                "GPT of GPT-2's size")
    config = GPT2Config() if size == "full" else GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=64, bos_token_id=0,
        eos_token_id=0)
    batch, seq = (8, 512) if size == "full" else (2, 32)

    def build() -> nn.Module:
        torch.manual_seed(0)
        with device:
            return GPT2LMHeadModel(config)  # type: ignore[no-any-return]

    ids = torch.randint(config.vocab_size, (batch, seq), device=device)
    params = sum(p.numel() for p in build().parameters())
    return Workload(f"GPT-2 (Hugging Face, {params / 1e6:.1f}M parameters), {batch} x {seq} "
                    "tokens, bf16 autocast, AdamW", build, ids,
                    lambda m, b: m(input_ids=b, labels=b).loss, "adamw", torch.bfloat16)


# -- one setup -------------------------------------------------------------------------------
def _wrap(label: str, net: nn.Module, opt: torch.optim.Optimizer) -> nn.Module:
    import hexagram as hx

    if label == "no wrapper":
        return net
    if label == "torch DDP":
        return nn.parallel.DistributedDataParallel(net)
    return hx.DistributedDataParallel(net, optimizers=[opt], algorithm=algorithm(label))


@contextlib.contextmanager
def _setup(label: str, work: Workload, device: torch.device) -> Iterator[Callable[[], None]]:
    """One training step of ``work`` under ``label`` (forward, backward, optimizer step,
    zero_grad); the wrapper is closed on exit."""
    net = work.build()
    opt = optimizer(label, net.parameters(), work.optimizer)
    model = _wrap(label, net, opt)
    autocast = (torch.autocast(device.type, dtype=work.autocast) if work.autocast
                else contextlib.nullcontext())

    def step() -> None:
        with autocast:
            loss = work.loss(model, work.batch)
        loss.backward()
        opt.step()
        opt.zero_grad()

    try:
        yield step
    finally:
        close = getattr(model, "close", None)
        if callable(close):
            close()


def _ms(step: Callable[[], None], device: torch.device) -> float:
    """Milliseconds of one step: CUDA events around it on a GPU, the wall clock otherwise."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_setup(label: str, work: Workload, device: torch.device) -> dict[str, Any]:
    """Median, mean and largest step time of :data:`TIMED` steps after :data:`WARMUP`
    (the mean holds a period-4 algorithm's communicating steps), and peak memory."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with _setup(label, work, device) as step:
        for _ in range(WARMUP):
            step()
        times = [_ms(step, device) for _ in range(TIMED)]
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"median_ms": round(statistics.median(times), 2),
            "mean_ms": round(statistics.fmean(times), 2), "max_ms": round(max(times), 2),
            "peak_gib": None if peak is None else round(peak, 2)}


# -- every setup, within a budget ----------------------------------------------------------
def _each(labels: list[str], measure: Callable[[str], dict[str, Any]],
          deadline: float) -> dict[str, Any]:
    """``measure(label)`` per label; a failure or a setup past ``deadline`` is its row."""
    rows: dict[str, Any] = {}
    for label in labels:
        if time.monotonic() > deadline:
            rows[label] = "skipped: the part's time limit was reached"
            continue
        try:
            rows[label] = measure(label)
        except Exception as exc:  # one failed setup must not end the table
            rows[label] = f"failed: {type(exc).__name__}: {exc}"
        _release()
    return rows


def _release() -> None:
    """Frees the last setup (its model, optimizer state and wrapper, cycles included), so
    the next setup's peak memory is its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _with_ratios(rows: dict[str, Any]) -> dict[str, Any]:
    """Adds ``x_ddp`` (median step over torch DDP's median, from the same run)."""
    ddp = rows.get("torch DDP")
    base = ddp["median_ms"] if isinstance(ddp, dict) else None
    for row in rows.values():
        if isinstance(row, dict) and base:
            row["x_ddp"] = round(row["median_ms"] / base, 2)
    return rows


def time_models(names: list[str], budget_s: float, size: str = "full") -> dict[str, Any]:
    """The ``model`` part's worker: every setup on the MLP, then on GPT-2."""
    import hexagram as hx

    device = hx.init().device
    start = time.monotonic()
    labels = [*REFERENCES, *names]
    out: dict[str, Any] = {"device": str(device), "configs": CONFIGS,
                           "steps": f"median of {TIMED} after {WARMUP} warm-up steps"}
    mlp = mlp_workload(device, size)
    out["mlp"] = {"model": mlp.title, "setups": _with_ratios(_each(
        labels, lambda label: time_setup(label, mlp, device), start + MLP_SHARE * budget_s))}
    gpt = gpt2_workload(device, size)
    if isinstance(gpt, str):
        out["gpt2"] = {"status": gpt}
    else:
        out["gpt2"] = {"model": gpt.title, "setups": _with_ratios(_each(
            labels, lambda label: time_setup(label, gpt, device), start + budget_s))}
    return out


# -- profile -------------------------------------------------------------------------------
def _top(events: Any, attr: str) -> list[dict[str, Any]]:
    ranked = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:TOP]
    return [{"op": e.key, "ms": round(getattr(e, attr) / 1e3, 3), "calls": e.count}
            for e in ranked if getattr(e, attr) > 0]


def _profiled(step: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """torch.profiler over one step, every thread: top ops by self CUDA and self CPU time,
    kernel launches, total self times."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities,
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    return {"cuda_ms": round(sum(e.self_device_time_total for e in events) / 1e3, 2),
            "cpu_ms": round(sum(e.self_cpu_time_total for e in events) / 1e3, 2),
            "launches": sum(e.count for e in events if "LaunchKernel" in e.key),
            "by_cuda": _top(events, "self_device_time_total") if cuda else [],
            "by_cpu": _top(events, "self_cpu_time_total")}


def _syncs(step: Callable[[], None], device: torch.device) -> int | None:
    """Host syncs of one step (``torch.cuda.set_sync_debug_mode("warn")``); None on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def profile_setup(label: str, work: Workload, device: torch.device) -> dict[str, Any]:
    """After :data:`WARMUP` steps: one profiled step, then one step's host syncs."""
    with _setup(label, work, device) as step:
        for _ in range(WARMUP):
            step()
        row = _profiled(step, device)
        row["syncs"] = _syncs(step, device)
    return row


def profile_setups(names: list[str], budget_s: float, size: str = "full") -> dict[str, Any]:
    """The ``profile`` part's worker: one profiled steady step of the MLP per setup."""
    import hexagram as hx

    device = hx.init().device
    mlp = mlp_workload(device, size)
    rows = _each([*REFERENCES, *names], lambda label: profile_setup(label, mlp, device),
                 time.monotonic() + budget_s)
    return {"device": str(device), "model": mlp.title, "configs": CONFIGS, "setups": rows}


# -- report ----------------------------------------------------------------------------------
def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def model_markdown(result: dict[str, Any]) -> str:
    """The ``model`` part as Markdown tables, one per workload, x torch DDP per setup."""
    lines = [f"Steps: {result.get('steps')}; algorithm configs: `{result.get('configs')}`."]
    for half in ("mlp", "gpt2"):
        part = result.get(half, {})
        if "setups" not in part:
            lines += ["", f"{half}: {part.get('status', 'not run')}"]
            continue
        lines += ["", f"{part['model']}:", "",
                  "| setup | median ms | mean ms | max ms | x torch DDP | peak GiB |",
                  "|---|---:|---:|---:|---:|---:|"]
        for label, row in part["setups"].items():
            if isinstance(row, str):
                lines.append(f"| {label} | {row} | | | | |")
                continue
            cells = [row["median_ms"], row["mean_ms"], row["max_ms"], row.get("x_ddp"),
                     row["peak_gib"]]
            lines.append(f"| {label} | " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def _ops(top: list[dict[str, Any]]) -> str:
    return ", ".join(f"`{o['op']}` {o['ms']} ms x{o['calls']}" for o in top) or "-"


def profile_markdown(result: dict[str, Any]) -> str:
    """The ``profile`` part: a summary row per setup, then each setup's top ops."""
    lines = [f"{result.get('model')}; one steady step per setup (self times, every "
             "thread).", "",
             "| setup | CUDA ms | CPU ms | kernel launches | host syncs |",
             "|---|---:|---:|---:|---:|"]
    details: list[str] = []
    for label, row in result.get("setups", {}).items():
        if isinstance(row, str):
            lines.append(f"| {label} | {row} | | | |")
            continue
        cells = [row["cuda_ms"], row["cpu_ms"], row["launches"], row["syncs"]]
        lines.append(f"| {label} | " + " | ".join(_cell(c) for c in cells) + " |")
        details += [f"- {label}: by CUDA time: {_ops(row['by_cuda'])}; "
                    f"by CPU time: {_ops(row['by_cpu'])}"]
    return "\n".join([*lines, "", f"Top {TOP} ops per setup:", "", *details])
