"""Predict every algorithm's step time on a cluster you do not have, and pick one.

    python examples/simulate.py
    python examples/simulate.py --inter 100gbe --world 16,128,1024

The same step-time model `algorithm="auto"` and ``hexagram advise`` use, fed with a
device's datasheet figures and link presets instead of measurements (``hexagram simulate``
is the command-line form). A 350M-parameter GPT (24 blocks of width 1024) on H100 hosts of 8
GPUs; nothing runs on a network. A few seconds on any machine.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from hexagram.cost.devices import device
from hexagram.cost.simulate import Cluster, device_compute, reference_tensors, simulate


def main(argv: Sequence[str] | None = None) -> dict[int, str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="allreduce,fp16,powersgd,topk,gtopk,diloco")
    parser.add_argument("--world", default="8,64,512", help="world sizes, comma-separated")
    parser.add_argument("--inter", default="25gbe", help="link between hosts (preset)")
    parser.add_argument("--device", default="h100")
    args = parser.parse_args(argv)

    gpu = device(args.device)
    tensors, tokens = reference_tensors("gpt", layers=24, width=1024, block=1024)
    compute = device_compute(tensors, gpu, samples=8, tokens=tokens)
    rows = simulate(args.algorithms.split(","), [int(w) for w in args.world.split(",")],
                    compute, Cluster(devices_per_host=8, inter=args.inter), gpu)
    print(f"{'algorithm':12s} {'world':>6s} {'step ms':>9s} {'exposed comm ms':>16s} "
          f"{'vs allreduce':>12s}")
    best: dict[int, tuple[float, str]] = {}
    for row in rows:
        if row.note:                                # e.g. skipped where it does not apply
            continue
        print(f"{row.label:12s} {row.world:6d} {1e3 * row.step_s:9.1f} "
              f"{1e3 * row.exposed_s:16.1f} {row.speedup:11.2f}x")
        if row.world not in best or row.step_s < best[row.world][0]:
            best[row.world] = (row.step_s, row.label)
    for world, (step_s, label) in best.items():
        print(f"at {world} devices on {args.inter}: {label} ({1e3 * step_s:.1f} ms/step)")
    return {world: label for world, (_s, label) in best.items()}


if __name__ == "__main__":
    main()
