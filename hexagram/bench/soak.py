"""Soak run of live mode on real data: replicas killed every K steps, restarted, healed.

:func:`run_soak` hosts a c10d ``TCPStore``, starts ``world`` replica processes that train an
MLP on Fashion-MNIST (or scikit-learn's digits) with :func:`hexagram.elastic.live`, kills
the replicas the ``kill`` spec names (``RANK@STEP[:ACTION],...``, as ``hexagram train
--kill``), starts each again a moment later (it rejoins and heals from a live peer) and
returns a summary: committed steps, steps lost (committed steps missing from a survivor's
log: 0 expected), dropped attempts, the stall per failure, healing times, the longest
step, the median step time and the final test accuracy of every replica.

The global batch is constant: at step ``s`` the ``world * batch`` samples of the step are
split among the members of the current membership (each takes ``1/size`` of them), so a
run with failures sees the same samples in the same order as one without. Steps, their
times and the kills run through :mod:`hexagram.bench.loop`, as every measurement's.

Example:
    >>> report = run_soak(world=4, steps=300, kill="1@100,2@200")   # doctest: +SKIP
    >>> report["steps_lost"], report["accuracy"]                    # doctest: +SKIP
    (0, 0.83)
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from hexagram.bench.loop import Loop, live_step, train_step
from hexagram.elastic.quorum import QuorumError
from hexagram.launch import clean_context, free_port, supervise
from hexagram.testing.faults import FaultInjector, parse_faults

__all__ = ["accuracy", "agree", "global_batch", "model_for", "params_digest", "replicas",
           "run_soak", "summarize", "train_cli"]

_SEED_STRIDE = 1_000_003  # data-order seeds of different runs never collide
_DATA: Any = None  # loaded once per process


def _data(name: str) -> Any:
    global _DATA
    if _DATA is None or _DATA[0] != name:
        from hexagram.data import fashion_mnist_available, load

        if name == "auto":
            name = "fashion-mnist" if fashion_mnist_available() else "digits"
        _DATA = (name, load(name))
    return _DATA[1]


def model_for(data: Any, hidden: int = 128, seed: int = 0) -> nn.Module:
    """The soak MLP (identical on every replica for a seed)."""
    torch.manual_seed(seed)
    side = data.x_train.shape[-1]
    return nn.Sequential(nn.Flatten(), nn.Linear(side * side, hidden), nn.ReLU(),
                         nn.Linear(hidden, data.classes))


def global_batch(data: Any, step: int, rank: int, size: int, world: int,
                 batch: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Member ``rank`` of ``size``'s share of step ``step``'s ``world * batch`` samples
    (the data order of ``seed``: each epoch a permutation seeded by the epoch and ``seed``;
    seed 0 is the order of the runs published before seeds existed)."""
    per_step = world * batch
    per_epoch = len(data.y_train) // per_step
    epoch, index = divmod(step, per_epoch)
    generator = torch.Generator().manual_seed(epoch + _SEED_STRIDE * seed)
    perm = torch.randperm(len(data.y_train), generator=generator)
    ids = perm[index * per_step:(index + 1) * per_step].tensor_split(size)[rank]
    return data.x_train[ids], data.y_train[ids]


@torch.no_grad()
def params_digest(model: nn.Module) -> str:
    """SHA-256 of ``model``'s parameters and buffers (equal iff bitwise equal)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def accuracy(model: nn.Module, data: Any) -> float:
    """Test accuracy of ``model``."""
    correct = sum(int((model(xb).argmax(1) == yb).sum())
                  for xb, yb in zip(data.x_test.split(2000), data.y_test.split(2000)))
    return correct / len(data.y_test)


def _replica(replica: int, world: int, port: int, cfg: dict[str, Any], incarnation: int,
             out: str, data: Any) -> None:
    """One replica's process. ``data`` comes from the parent (multiprocessing shares its
    tensors' memory): a restarted replica is ready at once, not after ~1.5 s of importing
    scikit-learn, so it rejoins a short run before the survivors finish it."""
    from hexagram.elastic import live

    os.environ.update(MASTER_ADDR=cfg.get("master_addr", "127.0.0.1"), MASTER_PORT=str(port),
                      RANK=str(replica), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    model = model_for(data, seed=cfg["seed"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    report: dict[str, Any] = {"restarted": incarnation > 0, "log": [], "times": []}
    try:
        trainer = live(model, [opt], cfg["algorithm"], algorithm_config=cfg["config"],
                       min_size=cfg["min_size"], heartbeat_timeout=cfg["heartbeat_timeout"],
                       timeout=cfg["timeout"], join_timeout=cfg["join_timeout"],
                       residuals=cfg["residuals"])
        _train(trainer, data, world, cfg, injector_for(cfg["kill"], replica, incarnation),
               report)
    except QuorumError as exc:  # e.g. restarted after the others finished
        report["error"] = str(exc)
    report["accuracy"] = accuracy(model, data)
    torch.save(report, Path(out) / f"replica{replica}_{incarnation}.pt")


def injector_for(kill: str, replica: int, incarnation: int) -> FaultInjector:
    """The faults of ``replica``'s ``incarnation``-th restart: its rank's faults from the
    ``incarnation``-th on, in step order (the earlier ones killed its predecessors; a
    restarted replica may rejoin at the very step that killed the last one)."""
    mine = sorted((f for f in parse_faults(kill) if f.rank == replica), key=lambda f: f.step)
    return FaultInjector(mine[incarnation:], replica)


def _train(trainer: Any, data: Any, world: int, cfg: dict[str, Any],
           injector: FaultInjector, report: dict[str, Any]) -> None:
    report["memberships"] = trainer.stats["memberships"]  # kept if a QuorumError ends it
    loop = Loop(step=live_step(trainer, F.cross_entropy), faults=injector,
                times=report["times"])  # kept too
    while trainer.step < cfg["steps"]:
        x, y = global_batch(data, trainer.step, trainer.rank, trainer.size, world,
                            cfg["batch"], cfg["seed"])
        if loop.run(x, y, at=trainer.step):
            report["log"].append(trainer.step - 1)
    report.update(stats=trainer.stats, step=trainer.step,
                  params_sha256=params_digest(trainer.module))
    trainer.close()


def run_soak(world: int = 4, steps: int = 300, kill: str = "1@100,2@200",
             algorithm: str = "allreduce", config: dict[str, Any] | None = None,
             dataset: str = "auto", batch: int = 32, lr: float = 0.05,
             heartbeat_timeout: float = 0.5, timeout: float = 30.0,
             join_timeout: float = 30.0, restart_delay: float = 1.0,
             min_size: int | None = None,
             deadline: float = 1800.0, seed: int = 0,
             residuals: str = "reset") -> dict[str, Any]:
    """Run the soak (see the module doc) and return :func:`summarize` of the replicas.
    ``seed`` picks the initial weights and the data order (:func:`model_for`,
    :func:`global_batch`); a run with failures and one without compare on the same seed.
    ``residuals``: live mode's policy for error-feedback residuals at a membership change
    (:mod:`hexagram.elastic.residuals`).

    Raises:
        RuntimeError: a replica crashed (other than the injected kills) or the run passed
            ``deadline`` seconds.
    """
    data = _data(dataset)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    cfg = {"steps": steps, "kill": kill, "algorithm": algorithm, "config": config or {},
           "dataset": dataset, "batch": batch, "lr": lr,
           "min_size": min_size or max(1, world - 1),
           "heartbeat_timeout": heartbeat_timeout, "timeout": timeout,
           "join_timeout": join_timeout, "seed": seed, "residuals": residuals}
    kills = Counter(f.rank for f in parse_faults(kill))
    ctx = clean_context()  # never fork: this process hosts the store's server thread
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        procs = {r: ctx.Process(target=_replica, args=(r, world, port, cfg, 0, out, data))
                 for r in range(world)}
        for proc in procs.values():
            proc.start()
        in_time = supervise(procs, lambda r, n: ctx.Process(
            target=_replica, args=(r, world, port, cfg, n, out, data)), kills,
            restart_delay, time.monotonic() + deadline)
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        del store
        codes = {r: p.exitcode for r, p in procs.items()}
        if not in_time or any(code != 0 for code in codes.values()):
            raise RuntimeError(f"soak run failed: exit codes {codes}"
                               f"{'' if in_time else f'; overran {deadline:.0f} s'}")
        reports = {f.name[7:-3]: torch.load(f, weights_only=False)
                   for f in Path(out).glob("*.pt")}
    return summarize(reports, steps, kill, time.perf_counter() - started)


def _plain_rank(steps: int, dataset: str, batch: int, lr: float,
                seed: int) -> dict[str, Any]:
    dist.init_process_group("gloo")
    data = _data(dataset)
    model = torch.nn.parallel.DistributedDataParallel(model_for(data, seed=seed))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    rank, world = dist.get_rank(), dist.get_world_size()
    loop = Loop(step=train_step(model, opt, F.cross_entropy))
    for step in range(steps):
        loop.run(*global_batch(data, step, rank, world, world, batch, seed))
    result = {"times": loop.times, "accuracy": accuracy(model.module, data)}
    dist.destroy_process_group()
    return result


def plain_ddp(world: int = 4, steps: int = 300, dataset: str = "auto", batch: int = 32,
              lr: float = 0.05, timeout: float = 600.0, seed: int = 0) -> dict[str, Any]:
    """The soak's training without fault tolerance: PyTorch DDP on gloo, the same model,
    batches and optimizer. Its median step is the baseline that the per-step overhead of a
    fault-tolerant engine is measured against."""
    from hexagram.launch import run_local

    ranks = run_local(_plain_rank, world, (steps, dataset, batch, lr, seed), timeout=timeout)
    times = [t for r in ranks for t in r["times"][1:]]  # the first step builds buckets
    return {"steps": steps, "kills": 0, "median_step_ms": 1000 * statistics.median(times),
            "accuracy": statistics.mean(r["accuracy"] for r in ranks),
            "accuracy_spread": max(r["accuracy"] for r in ranks)
            - min(r["accuracy"] for r in ranks)}


def summarize(reports: dict[str, dict[str, Any]], steps: int, kill: str,
              wall_s: float) -> dict[str, Any]:
    """One summary of the replicas' reports (keys ``"<replica>_<incarnation>"``)."""
    finished = [r for r in reports.values() if "step" in r]  # others: "error"
    survivors = [r for key, r in reports.items() if key.endswith("_0") and "step" in r]
    lost = max((r["step"] - len(r["log"]) for r in survivors), default=0)
    stalls = sorted(s for r in survivors for s in r.get("stats", {}).get("stall_s", []))
    heals = sorted(s for r in reports.values() for s in r.get("stats", {}).get("heal_s", []))
    times = [t for r in survivors for t in r["times"]]
    accs = [r["accuracy"] for r in finished]
    return {"steps": steps, "kills": len(parse_faults(kill)), "wall_s": wall_s,
            "steps_lost": lost,
            "dropped_attempts": max((len(r["times"]) - len(r["log"]) for r in survivors),
                                    default=0),
            "stall_s": stalls, "heal_s": heals,
            "longest_step_s": max(times, default=0.0),
            "median_step_ms": 1000 * statistics.median(times) if times else 0.0,
            "accuracy": statistics.mean(accs) if accs else None,
            "accuracy_spread": max(accs) - min(accs) if accs else None,
            "rejoined": sum(1 for key, r in reports.items()  # restarts that finished
                            if not key.endswith("_0") and "step" in r),
            "errors": [r["error"] for r in reports.values() if "error" in r],
            "replicas_identical": agree(reports), "replicas": replicas(reports)}


def agree(reports: dict[str, dict[str, Any]]) -> bool | None:
    """Whether every replica that finished holds the same final step and the same
    parameters (by hash); None when fewer than two finished."""
    finished = [(r["step"], r.get("params_sha256")) for r in reports.values()
                if "step" in r]
    return None if len(finished) < 2 else len(set(finished)) == 1


def replicas(reports: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per replica incarnation (``"<replica>_<incarnation>"``): its final step, the hash
    of its parameters, its accuracy, error, and the memberships it set up (epoch, members,
    their registered steps, its step after set-up, the heal source)."""
    out = {}
    for key, r in sorted(reports.items()):
        stats = r.get("stats", {})
        out[key] = {"step": r.get("step"), "params_sha256": r.get("params_sha256"),
                    "accuracy": r.get("accuracy"), "error": r.get("error"),
                    "committed": len(r.get("log", [])), "attempts": len(r.get("times", [])),
                    "failures": stats.get("failures"),
                    "heals": len(stats.get("heal_s", [])),
                    "memberships": r.get("memberships", [])}
    return out


def train_cli(args: Any) -> int:
    """``hexagram train --live``: :func:`run_soak` per algorithm of ``--algorithms`` with
    ``--hosts x --ranks-per-host`` replicas on loopback, ``--steps`` steps and the
    ``--kill`` faults (killed replicas restart); prints one JSON summary per algorithm
    (and writes them to ``--json``). Returns 1 if a run failed, 0 otherwise."""
    import json
    import sys

    from hexagram.bench.cli import algorithm_list, split_label
    from hexagram.errors import ConfigError

    parse_faults(args.kill)  # malformed: ConfigError before any replica starts
    dataset = "digits" if args.dataset == "auto" and not _has_fashion() else args.dataset
    if dataset == "text":
        raise ConfigError("hexagram train --live trains the image MLP: use --dataset "
                          "fashion-mnist, digits or auto")
    results, failed = [], 0
    for label in algorithm_list(args.algorithms):
        name, config = split_label(label)
        if name == "ddp":  # in the default --algorithms
            print("hexagram train --live: skipping ddp (PyTorch DDP has no live mode)",
                  file=sys.stderr)
            continue
        try:
            row = {"algorithm": label, **run_soak(
                args.hosts * args.ranks_per_host, args.steps, args.kill, name, config,
                dataset, args.batch, args.lr or 0.05, restart_delay=0.3,
                deadline=args.timeout)}
        except RuntimeError as exc:
            row, failed = {"algorithm": label, "error": str(exc)}, 1
        results.append(row)
        print(json.dumps(row, default=str), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"live": True, "results": results}, f, indent=1, default=str)
    print(f"hexagram train --live: {len(results)} run(s), {failed} failed", file=sys.stderr)
    return failed


def _has_fashion() -> bool:
    from hexagram.data import fashion_mnist_available

    return fashion_mnist_available()
