"""``hexagram simulate`` against the network lab: recorded runs, or new ones.

Recorded: the step tables of docs/benchmarks/network.md (``#### H hosts x R rank(s), BW
links, mlp (N parameters), batch B/rank``) hold every figure a prediction needs: the mean
step, the local step and the CPU per step. ``--recorded`` parses them, writes the fixture
``tests/data/simulate_lab_recorded.json`` (``--fixture``) and prints the comparison table.

New runs (``--run``, root, needs ``ip`` and ``tc``; every lab removes its namespaces on
exit): ``hexagram bench`` at each ``--hosts`` and ``--bandwidth``, then the same comparison,
with the local step's *wall* time from the run's JSON as compute (it carries the machine's
load; the Markdown tables only show CPU time, stretched by ranks / cores instead).
``--records`` reads earlier records (a fixture) back, so new runs add to it.

    .venv/bin/python benchmarks/simulate_validation.py --recorded docs/benchmarks/network.md \\
        --bench-json 2=/tmp/simval/bench_2.json,3=/tmp/simval/bench_3.json \\
        --fixture tests/data/simulate_lab_recorded.json
    sudo .venv/bin/python benchmarks/simulate_validation.py --run --hosts 2,3,4 \\
        --bandwidth 10mbit,100mbit,1gbit --steps 6 --out /tmp/simval
    sudo .venv/bin/python benchmarks/simulate_validation.py --run --hosts 2,3,4 \\
        --bandwidth 10mbit --params 1000000 --steps 4 --out /tmp/simval10  # 10.5 M: 34-50 s
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness.simulate_lab import LabRecord, compare

from hexagram import algorithms

HEADER = re.compile(r"^#### (\d+) hosts x (\d+) rank\(s\), (\w+) links, (\w+) \((\d+) "
                    r"parameters\), batch (\d+)/rank")
CPU = re.compile(r"([\d.]+), kernel ([\d.]+) \(([\d.]+)\)")
#: the runs' settings (network.md's commands): labels as the simulator takes them
LABELS = {"powersgd": "powersgd:start_iter=0", "diloco": "diloco:period=8",
          "local_sgd": "local_sgd:period=8"}
SKIP = ("ddp", "async")  # PyTorch's own; async's bytes depend on wall time, not steps


def parse_markdown(text: str) -> list[LabRecord]:
    """Every shaped (``NNmbit`` / ``NNgbit``) step table of a bench Markdown page, with the
    ``--layers`` of the section's command."""
    layers = 3
    out, setting = [], None
    for line in text.splitlines():
        if line.startswith("## "):
            layers = 3  # bench's default, until a command in the section sets it
        flag = re.search(r"--layers (\d+)", line)
        if flag:
            layers = int(flag.group(1))
        m = HEADER.match(line)
        if m:
            h, r, bw, model, params, batch = m.groups()
            setting = (int(h), int(r), bw, model, int(params), int(batch))
            if not bw.endswith("bit"):
                setting = None
            continue
        if setting is None or not line.startswith("| ") or "failed" in line:
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        cpu = CPU.search(cells[-1])
        if cpu is None or cells[0].startswith(SKIP):
            continue
        h, r, bw, model, params, batch = setting
        total, kernel, local = (float(x) for x in cpu.groups())
        out.append(LabRecord(hosts=h, ranks_per_host=r, bandwidth=bw, model=model,
                             params=params, layers=layers, batch=batch,
                             label=LABELS.get(cells[0], cells[0]),
                             measured_s=float(cells[1]), local_s=local,
                             extra_cpu_s=max(0.0, total - kernel - local),
                             reported_mb=float(cells[5])))
    return out


def table(records: list[LabRecord]) -> str:
    rows, median = compare(records)
    kept = {id(rec) for rec, _, _ in rows}
    dropped = [f"{r.label} ({r.hosts} x {r.ranks_per_host}, {r.bandwidth})" for r in records
               if id(r) not in kept]
    out = ["| hosts | link | algorithm | predicted s | measured s | error |",
           "|---|---|---|---|---|---|"]
    for rec, row, err in rows:
        out.append(f"| {rec.hosts} x {rec.ranks_per_host} | {rec.bandwidth} | {rec.label} | "
                   f"{row.step_s:.3f} | {rec.measured_s:.3f} | {100 * err:+.0f} % |")
    out.append(f"\nmedian |error| {100 * median:.0f} % over {len(rows)} rows; left out "
               f"(bytes per step differ from the run's: a default changed since, or a periodic "
               f"algorithm whose short timed window held more than 1/period rounds): "
               f"{', '.join(dropped) or 'none'}")
    return "\n".join(out)


def _pinned(label: str) -> str:
    """``label`` with the density it ran at (today's default) when the algorithm has one and
    the label sets none: the record stays comparable after the default changes."""
    if ":" in label:
        return label
    density = getattr(algorithms.get(label).config, "density", None)
    return label if density is None else f"{label}:density={density}"


def _from_bench(report: dict[str, Any], hosts: int, layers: int) -> list[LabRecord]:
    s, out = report["settings"], []
    for bw, rows in report["results"].items():
        for row in rows:
            label = row.get("label") or row.get("algorithm", "")
            if "step_s" not in row or label.startswith(SKIP) or not bw.endswith("bit"):
                continue
            # wall seconds of the local step: they carry the machine's load; CPU beyond it
            # is stretched by the same wall / CPU ratio (no further ranks / cores stretch)
            local, stretch = row["compute_s"], row["compute_s"] / row["compute_cpu_s"]
            extra = (row["cpu_s"] - (row.get("cpu_sys_s") or 0.0) - row["compute_cpu_s"])
            label = _pinned(LABELS.get(label, label))
            out.append(LabRecord(hosts=hosts, bandwidth=bw, label=label,
                                 measured_s=row["step_s"], local_s=local,
                                 extra_cpu_s=max(0.0, extra * stretch), params=s["params"],
                                 layers=layers, batch=s["batch"], cores=hosts,
                                 reported_mb=row["reported_bytes_per_step"] / 1e6))
    return out


def run_lab(args: argparse.Namespace) -> list[LabRecord]:
    """``hexagram bench`` at every host count (the bench removes its namespaces)."""
    Path(args.out).mkdir(parents=True, exist_ok=True)
    records = []
    for hosts in (int(h) for h in args.hosts.split(",")):
        path = Path(args.out) / f"bench_{hosts}.json"
        cmd = [sys.executable, "-m", "hexagram.cli", "bench", "--hosts", str(hosts),
               "--bandwidth", args.bandwidth, "--algorithms", args.algorithms,
               "--params", str(args.params), "--batch", "32", "--warmup", "2",
               "--steps", str(args.steps), "--time-limit", "30", "--stall-timeout", "60",
               "--set", "powersgd.start_iter=0", "--set", "diloco.period=8",
               "--set", "local_sgd.period=8", "--json", str(path), "--quiet"]
        subprocess.run(cmd, check=False, timeout=args.timeout)
        if path.exists():
            records += _from_bench(json.loads(path.read_text()), hosts, 3)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recorded", help="a bench Markdown page (docs/benchmarks/network.md)")
    ap.add_argument("--fixture", help="write the parsed records here (JSON)")
    ap.add_argument("--run", action="store_true", help="run the lab (root)")
    ap.add_argument("--records", help="earlier records (a fixture written by --fixture)")
    ap.add_argument("--bench-json", default="", metavar="HOSTS=FILE,...",
                    help="earlier --run outputs, e.g. 2=/tmp/simval/bench_2.json")
    ap.add_argument("--hosts", default="2,3,4")
    ap.add_argument("--bandwidth", default="10mbit,100mbit,1gbit")
    ap.add_argument("--algorithms", default="allreduce,fp16,powersgd,topk,gtopk,qsgd,"
                    "decentralized,local_sgd")
    ap.add_argument("--params", type=int, default=10_500_000)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=3600.0, help="per host count (s)")
    ap.add_argument("--out", default="/tmp/simulate-validation")
    args = ap.parse_args()
    records = (parse_markdown(Path(args.recorded).read_text()) if args.recorded else [])
    if args.records:
        records += [LabRecord(**r) for r in json.loads(Path(args.records).read_text())]
    for item in filter(None, args.bench_json.split(",")):
        hosts, path = item.split("=", 1)
        records += _from_bench(json.loads(Path(path).read_text()), int(hosts), 3)
    if args.run:
        records += run_lab(args)
    if args.fixture:
        Path(args.fixture).parent.mkdir(parents=True, exist_ok=True)
        Path(args.fixture).write_text(json.dumps([asdict(r) for r in records], indent=1))
    print(table(records))


if __name__ == "__main__":
    main()
