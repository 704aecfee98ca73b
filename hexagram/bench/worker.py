"""What every rank runs in the lab: ``python -m hexagram.bench.worker SPEC.json OUT_DIR``.

The spec (JSON) names the task (``"step"``: step-time benchmark, ``"train"``: time to
accuracy, ``"series"``: several step benchmarks in one launch, ``spec["runs"]`` each
overriding the spec's fields), the algorithm or PyTorch peer, the model and the settings.
Each rank writes ``OUT_DIR/rank<r>.json``: its figures, or ``{"error": ...}`` when the
algorithm failed (the process then exits with code 3, after which the lab stops its peers).

Step benchmark, per rank: local compute time of a step (all ranks computing at once, no
communication) with the moment each parameter's gradient is ready in it, then ``warmup``
wrapped steps, then the timed steps; bytes reported by the algorithm and bytes counted on
the host's interface over the timed steps; the process's CPU seconds per step, for the
local step and the timed steps (where the CPU is shared, an algorithm's own CPU work is
what it cannot overlap). The wrapped steps run through :mod:`hexagram.bench.loop`.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hexagram.bench import watchdog
from hexagram.bench.loop import Loop, train_step
from hexagram.bench.watchdog import beat
from hexagram.comm.device import control_tensor

__all__ = ["interface_tx_bytes", "main", "run_series", "run_step_benchmark"]


def interface_tx_bytes() -> int | None:
    """Bytes sent on the lab interface of this rank's host (None outside the lab)."""
    ifname = os.environ.get("HEXAGRAM_LAB_IFNAME")
    if not ifname:
        return None
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def _optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _agreed_steps(spec: dict[str, Any], warm_step_s: float) -> int:
    """Timed steps, cut so the run fits ``time_limit`` (same number on every rank)."""
    fit = int(spec["time_limit"] / max(warm_step_s, 1e-6))
    n = control_tensor([max(spec.get("min_steps", 3), min(spec["steps"], fit))])
    dist.all_reduce(n, op=dist.ReduceOp.MIN)  # every rank must run the same steps
    return int(n.item())


def _compute_time(work: Any, spec: dict[str, Any], gen: torch.Generator
                  ) -> dict[str, Any]:
    """The local step (forward, backward, update) without communication, as medians over
    ``compute_steps``: seconds (``compute_s``), process CPU seconds (``compute_cpu_s``),
    when backward returned (``backward_s``) and, per parameter in ``parameters()`` order,
    when its gradient was ready (``ready_s``) and its size (``ready_numel``)."""
    import copy

    model = copy.deepcopy(work.model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(params, spec["lr"])
    marks = [math.nan] * len(params)
    handles = [p.register_post_accumulate_grad_hook(_marker(marks, i))
               for i, p in enumerate(params)]
    rows: list[list[float]] = []
    dist.barrier()
    for _ in range(spec.get("compute_steps", 3) + 1):
        x, y = work.batch(spec["batch"], gen)
        marks[:] = [math.nan] * len(params)  # an unused parameter counts as ready at the end
        t0, c0 = time.perf_counter(), time.process_time()
        work.loss(model(x), y).backward()
        backward = time.perf_counter()
        opt.step()
        opt.zero_grad()
        total = time.perf_counter() - t0
        rows.append([total, time.process_time() - c0, backward - t0,
                     *((backward if math.isnan(m) else m) - t0 for m in marks)])
    for h in handles:
        h.remove()
    med = [statistics.median(col) for col in zip(*rows[1:])]  # the first step warms up
    return {"compute_s": med[0], "compute_cpu_s": med[1], "backward_s": med[2],
            "ready_s": med[3:], "ready_numel": [p.numel() for p in params]}


def _marker(marks: list[float], i: int) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook that stores when parameter ``i``'s gradient is ready."""

    def hook(_: torch.Tensor) -> None:
        marks[i] = time.perf_counter()
    return hook


def run_step_benchmark(spec: dict[str, Any]) -> dict[str, Any]:
    """Step-time figures of this rank (see module docstring)."""
    from hexagram.bench.peers import make_optimizer, wrap
    from hexagram.models.workload import ModelSpec, build_workload

    work = build_workload(ModelSpec(**spec["model"]), seed=spec.get("seed", 0))
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    beat("the local compute measurement")
    local = _compute_time(work, spec, gen)
    opt = make_optimizer(spec["algorithm"], work.model.parameters(), spec["lr"],
                         warmup=spec["warmup"])
    beat("wrapping the model")
    wrapped = wrap(spec["algorithm"], work.model, opt, spec.get("config") or {},
                   bucket_mb=spec.get("bucket_mb"))
    loop = Loop(step=train_step(wrapped.model, opt, work.loss, wrapped.after_step))
    for _ in range(spec["warmup"]):
        loop.run(*work.batch(spec["batch"], gen))
    warm = list(loop.times)
    steps = _agreed_steps(spec, warm[-1] if warm else local["compute_s"])
    batches = [work.batch(spec["batch"], gen) for _ in range(steps)]
    dist.barrier()
    b0, tx0, t0 = wrapped.bytes_sent(), interface_tx_bytes(), time.perf_counter()
    c0 = os.times()  # every thread of the rank: compression, gloo's, ours
    for x, y in batches:
        loop.run(x, y)
    window, c1 = time.perf_counter() - t0, os.times()
    b1, tx1 = wrapped.bytes_sent(), interface_tx_bytes()
    finite = all(torch.isfinite(p).all().item() for p in work.model.parameters())
    decision = wrapped.decision()
    wrapped.close()
    return {"step_times": loop.times[len(warm):], "window_s": window, "steps": steps, **local,
            "cpu_s": (c1.user + c1.system - c0.user - c0.system) / steps,
            # kernel time: sockets, and the softirqs of the shaped links that ran meanwhile
            "cpu_sys_s": (c1.system - c0.system) / steps, "in_backward": wrapped.in_backward,
            "warmup_times": warm, "reported_bytes": b1 - b0, "estimated": wrapped.estimated,
            "link_tx_bytes": None if tx0 is None or tx1 is None else tx1 - tx0,
            "num_params": work.num_params, "finite": bool(finite), "decision": decision}


def run_series(spec: dict[str, Any], out: Path, rank: int) -> dict[str, Any]:
    """Each of ``spec["runs"]`` as a step benchmark, one after the other, in this process:
    the ranks start (import torch, connect) once for all of them. An algorithm's error is
    its result; ``rank<r>.series.json`` holds the results so far (the harness reruns, one by
    one, what a hang or crash left without a result)."""
    runs: list[dict[str, Any]] = []
    for sub in spec["runs"]:
        try:
            result = run_step_benchmark({**spec, **sub, "task": "step"})
        except Exception as exc:  # this algorithm failed; the next ones still run
            result = {"error": f"{type(exc).__name__}: {exc}", "time": time.time(),
                      "traceback": traceback.format_exc()}
        runs.append({**result, "rank": rank})
        (out / f"rank{rank}.series.json").write_text(json.dumps(runs))
        dist.barrier()
    return {"runs": runs}


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    out = Path(args[1])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import hexagram as hx

    rank = int(os.environ.get("RANK", "0"))
    watchdog.start(spec.get("stall_timeout", 150.0), out / f"rank{rank}.json")
    code = 0
    try:
        hx.init(timeout=spec.get("comm_timeout", 120))
        if spec["task"] == "step":
            result = run_step_benchmark(spec)
        elif spec["task"] == "series":
            result = run_series(spec, out, rank)
        else:
            from hexagram.bench.trainloop import run_training

            result = run_training(spec)
    except Exception as exc:  # reported to the harness, which shows it
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                  "time": time.time()}
        code = 3
    result.update(rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                  host=os.environ.get("HEXAGRAM_HOST", ""))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if code == 0:
        hx.shutdown()  # barrier first: a peer still in a collective would abort otherwise
    return code


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os._exit(main())  # skip interpreter teardown: gloo threads can stall it
