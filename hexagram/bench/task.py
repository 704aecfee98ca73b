"""The probe as a job of its own: ``python -m hexagram.bench.task OUT_DIR [BUDGET_S]``.

Every rank (launched by torchrun, the network lab or :class:`LoopbackLab`) runs the network
probe and times each candidate compressor at once, so the costs include the contention of
all ranks sharing the machine; rank 0 writes ``OUT_DIR/probe.json``
(:func:`save_probe` format: ``{"network": ..., "costs": {label: [a, b, a', b']}}``), which
``hexagram advise --probe`` and ``benchmarks/cost_validation.py`` read.

Example:
    $ torchrun --nproc-per-node 4 -m hexagram.bench.task /tmp/probe
    $ hexagram advise --probe /tmp/probe/probe.json --model mlp
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hexagram.comm.device import group_tensor
from hexagram.cost.probe import NetworkProfile
from hexagram.cost.profile import CompressorCost

__all__ = ["candidate_labels", "load_probe", "main", "measure_costs", "run_in_lab",
           "save_probe"]


def candidate_labels() -> list[str]:
    """auto's default candidates plus every other registered gradient algorithm."""
    from hexagram.algorithms import registry
    from hexagram.auto import choose

    known = [n for n in registry.names() if n != "auto" and registry.get(n).kind == "grad"]
    labels = [c for c in choose.DEFAULT if choose.parse_label(c)[0] in known]
    return labels + [n for n in known if n not in labels]


def measure_costs(labels: Sequence[str], device: str = "cpu") -> dict[str, CompressorCost]:
    """Each label's compressor timed (labels without a compressor are left out)."""
    from hexagram.auto import choose
    from hexagram.cost.facts import compressor_of
    from hexagram.cost.profile import measure_compressor

    out: dict[str, CompressorCost] = {}
    for label in labels:
        comp = compressor_of(choose.make(label))
        if comp is not None:
            out[label] = measure_compressor(comp, device)
    return out


def save_probe(path: str | Path, network: NetworkProfile,
               costs: dict[str, CompressorCost]) -> None:
    data = {"network": network.to_json(),
            "costs": {k: [*v.compress, *v.decompress] for k, v in costs.items()}}
    Path(path).write_text(json.dumps(data, indent=1))


def load_probe(path: str | Path) -> tuple[NetworkProfile, dict[str, CompressorCost]]:
    """Read :func:`save_probe`'s file (a bare NetworkProfile JSON is accepted too)."""
    data = json.loads(Path(path).read_text())
    if "network" not in data:
        return NetworkProfile.from_json(data), {}
    costs = {k: CompressorCost((v[0], v[1]), (v[2], v[3])) for k, v in data["costs"].items()}
    return NetworkProfile.from_json(data["network"]), costs


def _agreed(costs: dict[str, CompressorCost]) -> dict[str, CompressorCost]:
    labels = sorted(costs)
    vec = group_tensor([x for lb in labels for x in (*costs[lb].compress,
                                                     *costs[lb].decompress)])
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    rows = vec.view(-1, 4).tolist() if labels else []
    return {lb: CompressorCost((r[0], r[1]), (r[2], r[3])) for lb, r in zip(labels, rows)}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (see module doc)."""
    args = list(sys.argv[1:] if argv is None else argv)
    out, budget = Path(args[0]), float(args[1]) if len(args) > 1 else 3.0
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import hexagram as hx
    from hexagram.comm.communicator import Communicator
    from hexagram.cost.probe import probe

    rt = hx.init()
    comm = Communicator(dist.new_group(list(range(rt.world_size))), rt.timeout, "probe",
                        owns_group=True)
    network = probe(comm, hosts=len(rt.hosts), budget_s=budget)
    costs = _agreed(measure_costs(candidate_labels(), str(rt.device)))
    if rt.rank == 0:
        save_probe(out / "probe.json", network, costs)
    comm.close()
    hx.shutdown()
    return 0


def run_in_lab(lab: Any, out: str | Path, budget_s: float = 3.0, timeout: float = 300.0
               ) -> tuple[NetworkProfile, dict[str, CompressorCost]]:
    """Run the probe job on every rank of ``lab`` (NetworkLab or LoopbackLab)."""
    results = lab.run([sys.executable, "-m", "hexagram.bench.task", str(out), str(budget_s)],
                      timeout=timeout)
    path = Path(out) / "probe.json"
    if not path.exists():
        tails = "\n".join(f"rank {r.rank}: {r.output[-600:]}" for r in results
                          if r.returncode != 0)
        raise RuntimeError(f"the probe job wrote no {path}:\n{tails}")
    return load_probe(path)


if __name__ == "__main__":
    raise SystemExit(main())
