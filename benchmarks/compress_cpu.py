"""CPU time of compression on the lab's 6.3M-parameter MLP: current code vs a git ref.

For each compressed algorithm of the network lab it measures, per training step and on one
thread (``torch.set_num_threads(1)``, as the lab's ranks run), the CPU time
(``time.thread_time``) of

- ``compress``: encoding every segment of a rank's gradient (``granularity="layer"``: each
  tensor; ``"bucket"``: the whole gradient as one tensor), with the algorithm's error
  feedback around it where it has one (``correct_`` + ``compress`` + ``update_from``);
- ``decode``: :func:`hexagram.compress.combine.decode_sum` of 4 ranks' payloads of every
  segment into one output (what each rank does after the allgather), with the algorithm's
  reduction (mean, or the sign for signSGD's majority vote).

The gradients are real: 4 backward passes of the MLP (784-h-h-h-10 from
:func:`hexagram.models.workload.build_workload`, batch 32) stand for 4 ranks. The
compressors are the algorithms' own (``hx.algorithms.get(name).compressor`` with their
defaults; ``dgc`` and ``gtopk`` measure their top-k sparsifier with plain error feedback;
gTop-k's rounds live in ``hexagram/comm/gtopk.py``: the row ``gtopk rounds (4 ranks)``
measures rank 0's merges and membership tests of its recursive doubling, in ``compress``).

With ``--ref REF`` the same measurement runs on the code of a git ref too: the ref is
checked out in a temporary worktree and measured by a second worker process importing
``hexagram`` from there; rounds alternate between the two workers (so load changes hit
both), and the tables give the median over rounds. The machine may be shared: the numbers
are noisy, compare them within one run.

Run: ``.venv/bin/python benchmarks/compress_cpu.py --rounds 7 [--ref 5d81124]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["main"]

ALGORITHMS = ("qsgd", "terngrad", "topk", "dgc", "gtopk", "signsgd", "efsign", "onebit",
              "bytegrad", "randomk")
RANKS = 4
ROOT = Path(__file__).resolve().parent.parent


def _gradients(ranks: int) -> list[list[Any]]:
    """``ranks`` lists of the MLP's gradients (one backward of batch 32 each)."""
    import torch

    from hexagram.models.workload import ModelSpec, build_workload

    work = build_workload(ModelSpec(name="mlp", params=6_300_000))
    grads = []
    for r in range(ranks):
        work.model.zero_grad()
        x, y = work.batch(32, torch.Generator().manual_seed(r))
        work.loss(work.model(x), y).backward()
        grads.append([p.grad.detach().clone() for p in work.model.parameters()
                      if p.grad is not None])
    return grads


def _pipeline(name: str, grads: list[list[Any]]) -> dict[str, Callable[[], None]]:
    """``{"compress": fn, "decode": fn}``: one step's compression work of algorithm ``name``
    (compress: rank 0's segments; decode: the 4 ranks' payloads of every segment)."""
    import torch

    import hexagram as hx
    from hexagram.compress.combine import decode_sum
    from hexagram.compress.feedback import ErrorFeedback

    algo = hx.algorithms.get(name)
    comp = algo.compressor  # type: ignore[attr-defined]  # compressed algorithms have one
    feedback = name in ("topk", "dgc", "gtopk", "efsign", "onebit", "randomk")
    if getattr(algo.config, "granularity", "layer") == "bucket":
        grads = [[torch.cat([g.reshape(-1) for g in rank])] for rank in grads]
    else:
        grads = [[g.reshape(-1) for g in rank] for rank in grads]
    majority = name == "signsgd"
    ef = ErrorFeedback(comp)
    bufs = [g.clone() for g in grads[0]]
    payloads = [[comp.compress(g) for g in rank] for rank in grads]
    outs = [torch.empty_like(g) for g in grads[0]]

    def compress() -> None:
        for i, (buf, g) in enumerate(zip(bufs, grads[0])):
            buf.copy_(g)
            if feedback:
                ef.correct_(i, buf)
                ef.update_from(i, buf, comp.compress(buf))
            else:
                comp.compress(buf)

    def finish(t: Any) -> Any:
        return t.sign_() if majority else t.div_(RANKS)

    def decode() -> None:
        for i, out in enumerate(outs):
            decode_sum(comp, [p[i] for p in payloads], out, finish)

    return {"compress": compress, "decode": decode}


def _gtopk_rounds(grads: list[list[Any]]) -> dict[str, Callable[[], None]]:
    """Rank 0's work in gTop-k's recursive doubling at 4 ranks, every tensor: (sort its own
    pairs, where the code does) merge with rank 1's pairs, mark its surviving pairs, merge
    with ranks 2+3's merged pairs, mark again (``hexagram/comm/gtopk.py``'s merge and
    membership test, whichever version is imported; no communication)."""
    import torch

    import hexagram as hx
    from hexagram.algorithms.gtopk import sparse_pairs
    from hexagram.comm import gtopk as g

    comp = hx.algorithms.get("gtopk").compressor  # type: ignore[attr-defined]
    sort = getattr(g, "_sort_pairs", lambda v, i: (v, i, None))
    isin = getattr(g, "_isin", torch.isin)
    Pair = tuple[Any, Any]
    jobs: list[tuple[Pair, Pair, Pair, int]] = []
    for t in range(len(grads[0])):
        pairs = [sparse_pairs(comp.compress(rank[t].reshape(-1))) for rank in grads]
        k = pairs[0][0].numel()
        (v1, i1, _), (v2, i2, _), (v3, i3, _) = (sort(*p) for p in pairs[1:])
        jobs.append((pairs[0], (v1, i1), g.merge_topk(v2, i2, v3, i3, k), k))

    def rounds() -> None:
        for (values, indices), (v1, i1), (vf, i_f), k in jobs:
            v, i, _ = sort(values, indices)
            v, i = g.merge_topk(v, i, v1, i1, k)
            alive = isin(indices, i)
            v, i = g.merge_topk(v, i, vf, i_f, k)
            alive &= isin(indices, i)

    return {"compress": rounds, "decode": lambda: None}


def _copy_baseline(grads: list[list[Any]]) -> dict[str, Callable[[], None]]:
    """A plain copy of rank 0's gradient (the scale of one memory pass)."""
    outs = [g.clone() for g in grads[0]]

    def copy() -> None:
        for out, g in zip(outs, grads[0]):
            out.copy_(g)

    return {"compress": copy, "decode": copy}


def worker() -> None:
    """Reads ``round`` lines on stdin; answers each with a JSON line of CPU ms per phase."""
    import torch

    torch.set_num_threads(1)
    grads = _gradients(RANKS)
    jobs = {"copy (baseline)": _copy_baseline(grads)}
    jobs.update({name: _pipeline(name, grads) for name in ALGORITHMS})
    jobs["gtopk rounds (4 ranks)"] = _gtopk_rounds(grads)
    for job in jobs.values():  # warm up: first-call allocations, lazily built tables
        for fn in job.values():
            fn()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        result: dict[str, dict[str, float]] = {}
        for name, job in jobs.items():
            result[name] = {}
            for phase, fn in job.items():
                start = time.thread_time()
                fn()
                result[name][phase] = (time.thread_time() - start) * 1e3
        print(json.dumps(result), flush=True)


class Worker:
    """A worker process importing ``hexagram`` from ``path``."""

    def __init__(self, label: str, path: Path) -> None:
        self.label = label
        env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"],
                                     cwd=path, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._read()  # {"ready": true}

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.label} exited (code {self.proc.wait()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def round(self) -> dict[str, dict[str, float]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _table(labels: list[str], runs: dict[str, list[dict[str, dict[str, float]]]]) -> str:
    """Markdown table: median CPU ms per phase and label, and new/old ratios."""
    names = list(runs[labels[0]][0])
    head = ["algorithm"]
    for phase in ("compress", "decode"):
        head += [f"{phase} {label}" for label in labels]
        if len(labels) == 2:
            head.append(f"{phase} ratio")
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        cells = [name]
        for phase in ("compress", "decode"):
            med = [statistics.median(r[name][phase] for r in runs[label]) for label in labels]
            cells += [f"{m:.1f}" for m in med]
            if len(labels) == 2:
                cells.append(f"{med[1] / med[0]:.2f}" if med[0] else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (>= 1)")
    parser.add_argument("--ref", default="", help="git ref to compare against (old code)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        return
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    tmp = tempfile.TemporaryDirectory(prefix="compress-cpu-")
    workers = []
    try:
        if args.ref:
            old = Path(tmp.name) / "old"
            subprocess.run(["git", "worktree", "add", "--detach", str(old), args.ref],
                           cwd=ROOT, check=True, capture_output=True)
            workers.append(Worker(f"old ({args.ref})", old))
        workers.append(Worker("current", ROOT))
        runs: dict[str, list[dict[str, dict[str, float]]]] = {w.label: [] for w in workers}
        for r in range(args.rounds):
            for w in workers if r % 2 == 0 else workers[::-1]:  # alternate who goes first
                runs[w.label].append(w.round())
        load = os.getloadavg()[0]
        print(f"# CPU ms per step (thread_time, 1 thread, median of {args.rounds} "
              f"interleaved rounds; load average {load:.1f}; noisy)")
        print(_table([w.label for w in workers], runs))
    finally:
        for w in workers:
            w.close()
        if args.ref:
            subprocess.run(["git", "worktree", "remove", "--force", str(Path(tmp.name) / "old")],
                           cwd=ROOT, check=False, capture_output=True)
        tmp.cleanup()


if __name__ == "__main__":
    main()
