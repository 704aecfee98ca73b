"""What checking received top-k pairs costs per rank and step, one thread.

A top-k payload of a bucket (the lab's 2.0M-parameter MLP by default, 1% density) is
checked as a receiver checks each of the ``--ranks`` gathered payloads: with the wire's
ascending order (``payload_fault``: neighbours compared) and, for reference, as it was
checked before the order (a sort of the indices to find repeats). Also timed: the
sender's sort (:func:`hexagram.compress.sparse_select.ascending`), the engine's arrival
pass over the reduced bucket (``aminmax``) and, for scale, the compression itself.

Usage::

    .venv/bin/python benchmarks/pair_checks.py --ranks 4 --density 0.01

Prints a Markdown table (milliseconds per rank and step) and the machine.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import torch

import hexagram.compress as hc
from hexagram.compress.faults import any_of, beyond, out_of_range
from hexagram.compress.segments import Segments
from hexagram.compress.sparse_select import ascending

#: the lab MLP's tensors (``bench --params 2000000``): two hidden layers and the head
LENGTHS = [1024 * 1024, 1024, 1024 * 928, 928, 9280, 10]


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Mean milliseconds of ``fn()`` over ``repeat`` calls after one warm-up call."""
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def sorted_check(values: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    """The check before the ascending order: range, values, and a sort to find repeats."""
    ordered = torch.sort(indices).values
    return any_of([beyond(values, values.dtype), out_of_range(indices, n),
                   (ordered[1:] == ordered[:-1]).any()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="payloads checked per step")
    parser.add_argument("--density", type=float, default=0.01, help="top-k density")
    parser.add_argument("--repeat", type=int, default=100, help="calls timed per figure")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(sum(LENGTHS), generator=torch.Generator().manual_seed(0))
    segments = Segments.of(LENGTHS)
    comp = hc.get("topk", density=args.density)
    payload = comp.compress_segments(x, segments)
    values, positions = payload.tensors
    shuffled = positions.long()[torch.randperm(positions.numel())]
    rows = [
        ("checks of the gathered payloads, ascending order (`payload_fault`)",
         args.ranks * timed(lambda: comp.payload_fault(payload), args.repeat)),
        ("checks of the gathered payloads, sorted to find repeats (before the order)",
         args.ranks * timed(lambda: sorted_check(values, positions, x.numel()), args.repeat)),
        ("the sender's sort of its indices (`ascending`)",
         timed(lambda: ascending(shuffled), args.repeat)),
        ("the arrival pass over the reduced bucket (`aminmax`)",
         timed(lambda: torch.aminmax(x), args.repeat)),
        ("for scale: `compress_segments` of the bucket",
         timed(lambda: comp.compress_segments(x, segments), max(1, args.repeat // 5))),
    ]
    print(f"{x.numel():,} elements, {positions.numel():,} pairs, {args.ranks} payloads "
          "checked per step, one thread\n")
    print("| per rank and step | ms |\n|---|---|")
    for label, ms in rows:
        print(f"| {label} | {ms:.2f} |")
    print(f"\nmachine: {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M %Z')}")


if __name__ == "__main__":
    main()
