"""The one-GPU check: staged, each part bounded, a markdown and JSON report in a folder.

Made for a GPU machine lent for about 10 minutes at a time, with its own Python and torch
and no package registry: it installs nothing, imports only torch and this checkout
(``PYTHONPATH=.``), and skips, with the reason, what needs a missing extra or CUDA.

Parts (run in the order given; ``all`` = every part):

- ``smoke`` (<= 3 min): the machine; one step of a few algorithms at world 1 on NCCL with a
  bucket past the compressors' multi-block sizes; 2 ranks with CUDA tensors over gloo.
- ``tier`` (<= 5 min): the ``gpu`` test tier (``pytest -m gpu tests/test_gpu.py
  tests/test_gpu_parallel.py``: every algorithm, the planner's DTensor/FSDP2 plans, ``auto``).
- ``hostile`` (<= 5 min): the checks of what arrives on CUDA (``pytest -m gpu`` of
  :data:`HOSTILE`, and of :data:`HOSTILE_HYPOTHESIS` where hypothesis is installed): every
  decoder on hostile bytes without a device-side assert, the fused Triton decoders against
  the eager ones on hostile bytes, the guard, robust's masked aggregation.
- ``sync`` (<= 5 min): host syncs of one steady training step per algorithm, counted with
  ``torch.cuda.set_sync_debug_mode`` (2 ranks, gloo+CUDA; the training thread's syncs).
- ``compress`` (<= 5 min): ``benchmarks/compress_throughput.py --device cuda``.
- ``model`` (<= 5 min): the step time at world 1 of a 100M-parameter MLP (SGD) and of a
  124M GPT-2 (bf16 autocast, AdamW; needs ``transformers``, else that half is skipped with
  the reason), with no wrapper, torch DDP and every algorithm, each as a ratio to torch
  DDP's step in the same run (CUDA events, median of 8 after 3 warm-up steps; peak memory).
- ``profile`` (<= 5 min): one steady step of the MLP per setup under ``torch.profiler``:
  the top 8 ops by CUDA and by CPU time, kernel launches, and the host syncs of a step
  (``torch.cuda.set_sync_debug_mode``).

The steps of ``model`` and ``profile`` live in ``scripts/gpu_check_steps.py`` (warm-ups
shortened so the timed steps are steady; weight algorithms at period 4).

Run: ``PYTHONPATH=. python scripts/gpu_check.py model profile --out gpu-report`` (the
Makefile's ``make gpu-check`` runs ``all``). Without CUDA every part reports ``skipped: no
CUDA`` and the script exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
for _path in (str(ROOT), str(HERE)):  # run as a script from anywhere; ranks import this
    if _path not in sys.path:           # file as the module gpu_check (spawned processes
        sys.path.insert(0, _path)       # cannot unpickle functions of __main__)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])

#: part -> wall-clock limit in seconds
LIMITS = {"smoke": 180, "tier": 300, "hostile": 300, "sync": 300, "compress": 300,
          "model": 300, "profile": 300}
#: the ``hostile`` part's test files; those that need hypothesis run only where it is installed
HOSTILE = ["tests/test_compress_triton_hostile.py", "tests/test_compress_triton.py",
           "tests/test_engine_guard.py", "tests/test_robust_masked.py"]
HOSTILE_HYPOTHESIS = ["tests/test_decoders_hostile.py"]
SPAWN_S = 45.0  # of a part's limit: starting the rank and NCCL, and slack
MULTI_BLOCK = 1 << 22  # elements of the large bucket: past every compressor's block size


# -- workers (run on spawned ranks) --------------------------------------------------------
def _step_algorithms(names: list[str], numel: int, steps: int) -> dict[str, Any]:
    from gpu_check_steps import algorithm, optimizer

    import hexagram as hx

    rt = hx.get_runtime() if hx.is_initialized() else hx.init()
    out: dict[str, Any] = {"backend": rt.backend, "device": str(rt.device)}
    for name in names:
        try:
            net = torch.nn.Linear(numel // 64, 64).to(rt.device)
            opt = optimizer(name, net.parameters(), lr=0.01)
            ddp = hx.DistributedDataParallel(net, optimizers=[opt], bucket_size_mb=64,
                                             algorithm=algorithm(name))
            for _ in range(steps):
                ddp(torch.randn(4, numel // 64, device=rt.device)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            ddp.synchronize()
            finite = bool(torch.isfinite(net.weight).all())
            ddp.close()
            out[name] = "ok" if finite else "non-finite weights"
        except Exception as exc:  # reported per algorithm
            out[name] = f"failed: {type(exc).__name__}: {exc}"
    return out


def _gloo_cuda(names: list[str], numel: int) -> dict[str, Any]:
    import hexagram as hx

    hx.init(backend="gloo", device="cuda")
    return _step_algorithms(names, numel, steps=2)


def _count_syncs(names: list[str]) -> dict[str, Any]:
    import warnings

    from gpu_check_steps import algorithm, optimizer

    import hexagram as hx

    rt = hx.init(backend="gloo", device="cuda")
    out: dict[str, Any] = {}
    for name in names:
        net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                  torch.nn.Linear(512, 10)).to(rt.device)
        opt = optimizer(name, net.parameters(), lr=0.01)
        try:
            ddp = hx.DistributedDataParallel(net, optimizers=[opt], bucket_size_mb=0.25,
                                             algorithm=algorithm(name))
            x = torch.randn(32, 256, device=rt.device)
            for step in range(3):
                if step == 2:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    ddp(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                torch.cuda.set_sync_debug_mode("default")
            out[name] = sum("synchroniz" in str(w.message) for w in caught)
            ddp.synchronize()
            ddp.close()
        except Exception as exc:
            torch.cuda.set_sync_debug_mode("default")
            out[name] = f"failed: {type(exc).__name__}: {exc}"
    return out


# -- parts (run in this process; multi-rank work on spawned ranks) -------------------------
def _worker(name: str, module: str = "gpu_check") -> Callable[..., Any]:
    """A rank function by reference to an importable module of this folder (``gpu_check``
    itself or ``gpu_check_steps``): spawned ranks cannot unpickle functions of __main__."""
    import importlib

    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _names() -> list[str]:
    import hexagram as hx

    return hx.algorithms.names()


def part_smoke(limit: float) -> dict[str, Any]:
    """The machine, world 1 on NCCL past the multi-block sizes, 2 ranks of gloo+CUDA."""
    from hexagram.launch import run_local

    props = torch.cuda.get_device_properties(0)
    out: dict[str, Any] = {
        "gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "gpus": torch.cuda.device_count(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version()}
    few = ["allreduce", "fp16", "topk", "powersgd", "qsgd"]
    out["world1_nccl"] = run_local(_worker("_step_algorithms"), 1, args=(few, MULTI_BLOCK, 2),
                                   timeout=limit / 2)[0]
    out["gloo_cuda_2_ranks"] = run_local(_worker("_gloo_cuda"), 2,
                                         args=(["allreduce", "fp16"], 1 << 16),
                                         timeout=limit / 3)
    return out


def part_tier(limit: float) -> dict[str, Any]:
    """``pytest -m gpu`` of the gpu tier files (skipped when this interpreter has no pytest):
    every algorithm, a CUDA checkpoint, live mode, the planner's DTensor/FSDP2 plans,
    ``auto``; each test's time is reported (``--durations``), to size the part."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"status": "skipped: pytest is not installed for this interpreter"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "-rs", "--durations=25", "tests/test_gpu.py", "tests/test_gpu_parallel.py"]
    return _subprocess(cmd, limit)


def part_hostile(limit: float) -> dict[str, Any]:
    """``pytest -m gpu`` of the checks of what arrives, on CUDA: every decoder on random,
    truncated-in-content and bit-flipped payloads (no device-side assert, a non-finite
    decode always flagged), the fused Triton decoders against the eager ones on hostile
    bytes, the engine's guard and robust's masked aggregation."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"status": "skipped: pytest is not installed for this interpreter"}
    files, note = list(HOSTILE), ""
    if importlib.util.find_spec("hypothesis") is not None:
        files += HOSTILE_HYPOTHESIS
    else:
        note = f"not run (hypothesis is not installed): {', '.join(HOSTILE_HYPOTHESIS)}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "-rs", "--durations=15", *files]
    out = _subprocess(cmd, limit)
    if note:
        out["note"] = note
    return out


def part_sync(limit: float) -> dict[str, Any]:
    """Host syncs of the training thread in one steady step, per algorithm (2 ranks)."""
    from hexagram.launch import run_local

    counts = run_local(_worker("_count_syncs"), 2, args=(_names(),), timeout=limit)
    return {"syncs_per_step_rank0": counts[0], "syncs_per_step_rank1": counts[1]}


def part_compress(limit: float) -> dict[str, Any]:
    """The compressor table on CUDA (benchmarks/compress_throughput.py)."""
    cmd = [sys.executable, "benchmarks/compress_throughput.py", "--device", "cuda",
           "--rounds", "3"]
    return _subprocess(cmd, limit)


def part_model(limit: float) -> dict[str, Any]:
    """Step times at world 1 of the MLP and GPT-2, every setup, x torch DDP."""
    from gpu_check_steps import model_markdown

    from hexagram.launch import run_local

    out: dict[str, Any] = run_local(_worker("time_models", "gpu_check_steps"), 1,
                                    args=(_names(), limit - SPAWN_S), timeout=limit)[0]
    out["markdown"] = model_markdown(out)
    return out


def part_profile(limit: float) -> dict[str, Any]:
    """One profiled steady step of the MLP per setup: top ops, launches, host syncs."""
    from gpu_check_steps import profile_markdown

    from hexagram.launch import run_local

    out: dict[str, Any] = run_local(_worker("profile_setups", "gpu_check_steps"), 1,
                                    args=(_names(), limit - SPAWN_S), timeout=limit)[0]
    out["markdown"] = profile_markdown(out)
    return out


PARTS: dict[str, Callable[[float], dict[str, Any]]] = {
    "smoke": part_smoke, "tier": part_tier, "hostile": part_hostile, "sync": part_sync,
    "compress": part_compress, "model": part_model, "profile": part_profile}


def _subprocess(cmd: list[str], limit: float) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=limit)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-4000:]
        return {"status": f"failed: over {limit:.0f} s", "output": str(tail)}
    status = "ok" if done.returncode == 0 else f"failed: exit code {done.returncode}"
    return {"status": status, "output": (done.stdout + done.stderr)[-6000:]}


# -- driver and report -----------------------------------------------------------------------
def run_parts(parts: list[str]) -> dict[str, Any]:
    """Run ``parts`` in order; each result has ``status`` and ``seconds``."""
    results: dict[str, Any] = {}
    for part in parts:
        if not torch.cuda.is_available():
            results[part] = {"status": "skipped: no CUDA (torch.cuda.is_available() is False)",
                             "seconds": 0.0}
            continue
        t0 = time.monotonic()
        try:
            res = PARTS[part](float(LIMITS[part]))
            res.setdefault("status", "ok")
        except Exception as exc:  # a failed part must not stop the others
            res = {"status": f"failed: {type(exc).__name__}: {exc}"}
        res["seconds"] = round(time.monotonic() - t0, 1)
        results[part] = res
    return results


def write_report(results: dict[str, Any], out: Path, argv: list[str]) -> None:
    """``gpu_check.json`` (everything) and ``gpu_check.md`` (a summary) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "PYTHONPATH=. python scripts/gpu_check.py " + " ".join(argv),
            "machine": platform.node(), "torch": torch.__version__,
            "cuda_available": torch.cuda.is_available()}
    (out / "gpu_check.json").write_text(json.dumps({"meta": meta, "parts": results},
                                                   indent=1, default=str))
    lines = ["# GPU check", "", f"- date: {meta['date']}", f"- command: `{meta['command']}`",
             f"- torch {meta['torch']}, CUDA available: {meta['cuda_available']}", "",
             "| part | status | seconds |", "|---|---|---|"]
    lines += [f"| {p} | {r['status']} | {r['seconds']} |" for p, r in results.items()]
    for part, res in results.items():
        if "markdown" in res:  # the part renders its own tables; the JSON has the rest
            lines += ["", f"## {part}", "", res["markdown"]]
            continue
        details = {k: v for k, v in res.items() if k not in ("status", "seconds", "output")}
        if details or "output" in res:
            lines += ["", f"## {part}", "", "```", json.dumps(details, indent=1, default=str)]
            lines += [str(res["output"])[-3000:]] if "output" in res else []
            lines += ["```"]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point; exits 0 unless a part failed (skipped parts do not fail)."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("parts", nargs="*", default=["smoke"],
                        choices=[*PARTS, "all"], help="parts to run, in order")
    parser.add_argument("--out", required=True, help="folder for gpu_check.md and .json")
    ns = parser.parse_args(args)
    parts = list(PARTS) if "all" in ns.parts else list(ns.parts)
    results = run_parts(parts)
    write_report(results, Path(ns.out), args)
    for part, res in results.items():
        print(f"{part}: {res['status']} ({res['seconds']} s)")
        if "markdown" in res:
            print(res["markdown"])
    return 1 if any(r["status"].startswith("failed") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
