"""Live mode under real failures: replicas as processes, one SIGKILLed and restarted.

:func:`run_live` hosts a c10d ``TCPStore`` (as torchrun's agent would), starts ``world``
replica processes that train a float64 MLP with :func:`hexagram.elastic.live`, kills one
with :mod:`hexagram.testing.faults` at a chosen step, optionally starts it again (it
rejoins and heals from a live peer), and returns what every replica reported: its final
parameters, the committed steps with the membership that took them, and its stats (stall
per failure, healing time, step times). :func:`replay` recomputes the committed steps in
one process (allreduce: the mean gradient of the members' batches), so a test can check
that no committed step was lost and no failed step was half-applied. Steps, their times
and the kills run through :mod:`hexagram.bench.loop`.

Run ``python -m hexagram.bench.live --steps 60 --kill 2@20`` for a measurement.

Example:
    >>> results = run_live(world=3, steps=30, kill="2@10")     # doctest: +SKIP
    >>> sorted(results)                                         # doctest: +SKIP
    [0, 1, 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hexagram.bench.loop import Loop, live_step
from hexagram.elastic.quorum import QuorumError
from hexagram.launch import clean_context, free_port, supervise
from hexagram.testing.faults import FaultInjector, parse_faults

__all__ = ["batch", "net", "replay", "run_live"]


def net(seed: int = 0) -> nn.Module:
    """The benchmark's MLP (float64, identical on every replica for a seed)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).double()


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s batch at ``step`` (deterministic)."""
    g = torch.Generator().manual_seed(7919 * step + replica)
    x = torch.randn(16, 8, generator=g, dtype=torch.float64)
    return x, torch.sin(x[:, :4]) + 0.1 * torch.randn(16, 4, generator=g, dtype=torch.float64)


def _optimizer(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)


def _replica(replica: int, world: int, port: int, cfg: dict[str, Any], restarted: bool,
             out: str) -> None:
    """One replica's process: train to ``steps``, then ``together`` more steps with every
    replica back in; a :class:`QuorumError` is reported, not raised."""
    from hexagram.elastic import live

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(replica),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    module = net().to(cfg["device"])
    opt = _optimizer(module)
    report: dict[str, Any] = {"digests": {}}
    try:
        trainer = live(module, [opt], cfg["algorithm"], algorithm_config=cfg["config"],
                       min_size=cfg["min_size"], heartbeat_timeout=cfg["heartbeat_timeout"],
                       timeout=cfg["collective_timeout"], join_timeout=cfg["join_timeout"],
                       **cfg["live_kwargs"])
        _train(trainer, replica, world, cfg, restarted, report)
    except QuorumError as exc:
        report["error"] = str(exc)
    report["device"] = str(next(module.parameters()).device)
    params = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).cpu()
    torch.save(report | {"params": params},
               Path(out) / f"replica{replica}_{int(restarted)}.pt")


def _digest(trainer: Any) -> dict[str, str]:
    """Hashes of this replica's model, optimizer and algorithm state (equal iff equal);
    ``"shared"``: the algorithm state without its error-feedback residuals (what a healed
    replica takes from its source), ``"residual"``: the residuals alone."""
    from hexagram.elastic.state import collect_rank_state, flatten, without_residuals

    state = collect_rank_state(trainer.model, trainer.optimizers, trainer.step, None)
    parts = {**state, "shared": without_residuals(state)["algorithm"],
             "residual": state["algorithm"].get("feedback", {}).get("residuals", {})}
    out = {}
    for part in ("model", "optimizers", "algorithm", "shared", "residual"):
        flat = flatten(parts[part], rank=0)
        blob = b"".join(flat[k].cpu().numpy().tobytes() for k in sorted(flat))
        out[part] = hashlib.sha256(blob).hexdigest()
    out["residual_is_zero"] = str(all(not t.any() for t in parts["residual"].values()))
    return out


def _train(trainer: Any, replica: int, world: int, cfg: dict[str, Any], restarted: bool,
           report: dict[str, Any]) -> None:
    injector = FaultInjector([] if restarted else parse_faults(cfg["kill"]), replica)
    loop = Loop(step=live_step(trainer, nn.functional.mse_loss), faults=injector,
                inside=cfg["kill_inside"])
    log: list[tuple[int, list[int]]] = []
    want = world if cfg["restart"] else world - len(parse_faults(cfg["kill"]))
    full_since: int | None = None  # step at which every wanted replica was in (same on all)
    epoch = None
    while trainer.step < cfg["steps"] or full_since is None \
            or trainer.step < full_since + cfg["together"] or trainer.step % cfg["align"]:
        if loop.steps > 20 * cfg["steps"]:
            raise RuntimeError(f"replica {replica}: no progress (size {trainer.size})")
        if trainer.epoch.number != epoch:
            epoch = trainer.epoch.number
            report["digests"][trainer.step] = _digest(trainer)
            full_since = trainer.step if trainer.size == want else None
        if not restarted:
            _maybe_pause(cfg["pause"], replica, trainer.step)
        members, (x, y) = list(trainer.epoch.members), batch(trainer.step, replica)
        if loop.run(x.to(cfg["device"]), y.to(cfg["device"]), at=trainer.step):
            log.append((trainer.step - 1, members))
        time.sleep(cfg["sleep"])
    report.update(log=log, stats=trainer.stats, times=loop.times, step=trainer.step)
    trainer.close()


_PAUSED: set[tuple[int, int]] = set()


def _maybe_pause(spec: str, replica: int, step: int) -> None:
    """``spec`` ``"RANK@STEP:SECONDS"``: at that step, stop this whole process (SIGSTOP:
    its heartbeat thread too, as a replica starved of CPU) and have a helper continue it
    SECONDS later. Once per step."""
    if not spec or (replica, step) in _PAUSED:
        return
    where, _, seconds = spec.partition(":")
    rank, _, at = where.partition("@")
    if (int(rank), int(at)) != (replica, step):
        return
    _PAUSED.add((replica, step))
    subprocess.Popen(["sh", "-c", f"sleep {float(seconds)}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


def run_live(world: int = 3, steps: int = 40, kill: str = "2@10", restart: bool = True,
             algorithm: str = "allreduce", heartbeat_timeout: float = 0.5,
             sleep: float = 0.02, timeout: float = 240.0, min_size: int | None = None,
             config: dict[str, Any] | None = None, together: int = 5,
             join_timeout: float = 60.0, restart_delay: float = 1.0,
             collective_timeout: float = 30.0, kill_inside: str = "", align: int = 1,
             pause: str = "", device: str = "cpu",
             **live_kwargs: Any) -> dict[int, dict[str, Any]]:
    """Run the replicas (see the module doc); returns each replica's final report.
    A killed replica is started again ``restart_delay`` s after it died. ``kill_inside``
    (``"all_reduce:2"``) fires the ``kill`` faults inside that collective call of the step
    instead of before the step. ``pause`` (``"RANK@STEP:SECONDS"``) stops that replica's
    process at that step for SECONDS (starved: alive, its heartbeat stale). Training ends
    on a multiple of ``align`` steps (a local SGD period: the replicas were just averaged).
    ``device``: where each replica's model lives (``"cuda"``: CUDA tensors over gloo; the
    replicas may share one GPU).

    Raises:
        RuntimeError: a replica failed (other than the injected kill) or overran ``timeout``.
    """
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    cfg = {"steps": steps, "kill": kill, "restart": restart, "algorithm": algorithm,
           "heartbeat_timeout": heartbeat_timeout, "sleep": sleep,
           "min_size": min_size or world - 1, "config": config or {},
           "together": together, "join_timeout": join_timeout, "live_kwargs": live_kwargs,
           "collective_timeout": collective_timeout, "kill_inside": kill_inside,
           "align": align, "pause": pause, "device": device}
    killed = {f.rank for f in parse_faults(kill)}
    ctx = clean_context()  # never fork: this process hosts the store's server thread
    with tempfile.TemporaryDirectory() as out:
        procs = {r: ctx.Process(target=_replica, args=(r, world, port, cfg, False, out))
                 for r in range(world)}
        for proc in procs.values():
            proc.start()
        in_time = supervise(procs, lambda r, _: ctx.Process(target=_replica,
                                                             args=(r, world, port, cfg,
                                                                   True, out)),
                             killed if restart else set(), restart_delay,
                             time.monotonic() + timeout)
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        del store
        codes = {r: p.exitcode for r, p in procs.items()}
        if any(code != 0 for r, code in codes.items() if r not in killed or restart):
            late = "" if in_time else f"; overran {timeout:.0f} s, killed"
            raise RuntimeError(f"live run failed: exit codes {codes}{late}")
        return {int(f.name[7:-5]): torch.load(f, weights_only=False) | {
            "restarted": f.name.endswith("_1.pt")} for f in Path(out).glob("*.pt")}




def replay(log: list[tuple[int, list[int]]]) -> torch.Tensor:
    """Parameters after applying the committed steps of ``log`` in one process
    (allreduce: the mean gradient of the members' batches, then SGD with momentum)."""
    module = net()
    opt = _optimizer(module)
    for step, members in log:
        for replica in members:
            x, y = batch(step, replica)
            (nn.functional.mse_loss(module(x), y) / len(members)).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill", default="2@20")
    parser.add_argument("--algorithm", default="allreduce")
    parser.add_argument("--heartbeat-timeout", type=float, default=0.5)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    results = run_live(args.world, args.steps, args.kill, True, args.algorithm,
                       args.heartbeat_timeout, args.sleep)
    summary = {r: {"step": res["step"], "restarted": res["restarted"],
                   "stall_s": res["stats"]["stall_s"], "heal_s": res["stats"]["heal_s"],
                   "steps_run": len(res["times"]),
                   "median_step_ms": 1000 * sorted(res["times"] or [0.0])[
                       len(res["times"]) // 2]}
               for r, res in sorted(results.items())}
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
