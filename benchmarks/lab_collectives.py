"""Raw gloo collective throughput on the lab's shaped links (no model, no Hexagram).

Shows how well each collective fills a link: ring allreduce and allgather keep one flow per
link; all-to-all sends to every peer at once, so P-1 flows converge on each receiver's
shaped port (incast), and a pairwise-shift all-to-all (one peer per round) pays a round
trip and a TCP ramp per round. Scatter-gather algorithms (bytegrad, qsgd) use all-to-all
for their first leg. The decentralized algorithms send to both ring neighbours at once.

    sudo .venv/bin/python benchmarks/lab_collectives.py --hosts 4 --bandwidth 100mbit

Prints, per collective: median seconds of 3 runs and the rate each rank's payload left at
(Mbit/s, payload bytes only: headers excluded), to compare with the link rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable


def _timed(fn: Callable[[], object], nbytes_sent: float) -> tuple[float, float]:
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    s = sorted(times)[1]
    return round(s, 3), round(nbytes_sent * 8 / s / 1e6, 1)


def _shifted_all_to_all(out: object, inp: object) -> None:
    """All-to-all as P-1 rounds of one send and one receive (rank r -> r+s)."""
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    blocks_in, blocks_out = inp.view(size, -1), out.view(size, -1)  # type: ignore[attr-defined]
    blocks_out[rank].copy_(blocks_in[rank])
    for s in range(1, size):
        dst, src = (rank + s) % size, (rank - s) % size
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, blocks_in[dst], dst),
                                            dist.P2POp(dist.irecv, blocks_out[src], src)]):
            work.wait()


def _ring_neighbours(send: object, recv: list[object]) -> None:
    """Send ``send`` to both ring neighbours and receive theirs, all four at once (the
    decentralized algorithms' exchange)."""
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    peers = [(rank - 1) % size, (rank + 1) % size]
    ops = [dist.P2POp(dist.isend, send, p) for p in peers]
    ops += [dist.P2POp(dist.irecv, r, p) for p, r in zip(peers, recv)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def rank_main(mbytes: float) -> None:
    """One rank: time each collective on ``mbytes`` MB per rank; rank 0 prints JSON."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    size = dist.get_world_size()
    n = int(mbytes * 1e6 / 4) // size * size
    x, out = torch.randn(n), torch.empty(n)
    part = torch.randn(n // size)
    parts = [torch.empty_like(part) for _ in range(size)]
    share = (size - 1) / size * 4 * n  # what each rank sends in all-to-all / reduce-scatter
    half = torch.randn(int(share / 4) // 2)  # sent to each of 2 neighbours: share in all
    halves = [torch.empty_like(half) for _ in range(2)]
    res = {"allreduce (ring)": _timed(lambda: dist.all_reduce(x), 2 * share),
           "allgather": _timed(lambda: dist.all_gather(parts, part), share),
           "all_to_all_single": _timed(lambda: dist.all_to_all_single(out, x), share),
           "all_to_all, pairwise shift": _timed(lambda: _shifted_all_to_all(out, x), share),
           "both ring neighbours": _timed(lambda: _ring_neighbours(half, halves), share)}
    if dist.get_rank() == 0:
        print(json.dumps(res))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--bandwidth", default="100mbit")
    parser.add_argument("--mbytes", type=float, default=8.0, help="MB per rank")
    parser.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_mode:
        rank_main(args.mbytes)
        return 0
    from hexagram.bench.lab import LabConfig, NetworkLab

    with NetworkLab(LabConfig(hosts=args.hosts, bandwidth=args.bandwidth)) as lab:
        results = lab.run([sys.executable, __file__, "--rank-mode", "--mbytes",
                           str(args.mbytes)], timeout=600)
    line = next((ln for ln in results[0].output.splitlines() if ln.startswith("{")), None)
    if line is None:
        print(results[0].output[-2000:], file=sys.stderr)
        return 1
    print(f"{args.hosts} hosts, {args.bandwidth}, {args.mbytes:g} MB per rank: "
          "collective -> [median s, Mbit/s per rank]")
    for name, (s, rate) in json.loads(line).items():
        print(f"  {name:28s} {s:7.3f} s  {rate:6.1f} Mbit/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
