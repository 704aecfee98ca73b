"""Parity and timing of a planned model against the single-process model (one rank's part).

Run :func:`parity_worker` on every rank (``hexagram.launch.run_local``): it builds the same
model on every rank, plans it, applies the plan, trains a few SGD steps next to an
unsharded copy and reports the largest loss and gradient differences and the step times.

Example:
    >>> from hexagram.launch import run_local
    >>> spec = ParitySpec(model="mlp", constraints={"tp": 2}, steps=5)
    >>> results = run_local(parity_worker, world_size=2, args=(spec,))   # doctest: +SKIP
    >>> max(r["grad_diff"] for r in results) < 1e-5                        # doctest: +SKIP
    True
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hexagram.parallel.cluster import Cluster, Constraints
from hexagram.parallel.models import ResidualMLP, gpt, mlp_stack

__all__ = ["ParitySpec", "build", "parity_worker"]


@dataclass(frozen=True, kw_only=True)
class ParitySpec:
    """What to build, plan and train (float64 by default, for 1e-5 parity)."""

    model: str = "mlp"
    layers: int = 2
    hidden: int = 16
    heads: int = 4
    vocab: int = 32
    seq: int = 8
    batch: int = 8
    steps: int = 5
    lr: float = 0.1
    seed: int = 0
    constraints: dict[str, Any] = field(default_factory=dict)
    cluster: Cluster | None = None
    reference: bool = True
    dtype: torch.dtype = torch.float64
    optimizer: str = "sgd"


def build(spec: ParitySpec) -> tuple[nn.Module, Any, Any]:
    """(model, inputs, targets) of one step, the same on every rank (seeded). Models:
    ``mlp``, ``gpt`` (``nn.Sequential``), ``residual`` (:class:`ResidualMLP`), ``refgpt``
    (:class:`hexagram.models.gpt.GPT`, a plain module) and ``cnn`` (8x8 images)."""
    torch.manual_seed(spec.seed)
    vocab, seq, b = spec.vocab, spec.seq, spec.batch
    if spec.model in ("gpt", "refgpt"):
        if spec.model == "gpt":
            model: nn.Module = gpt(layers=spec.layers, hidden=spec.hidden, heads=spec.heads,
                                   vocab=vocab, seq=seq, dtype=spec.dtype)
        else:
            from hexagram.models.gpt import GPT, GPTConfig
            model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=spec.layers,
                                  n_head=spec.heads, n_embd=spec.hidden)).to(spec.dtype)
        return model, torch.randint(0, vocab, (b, seq)), torch.randint(0, vocab, (b, seq))
    if spec.model == "cnn":
        from hexagram.models.cnn import cnn
        model = cnn(image_size=8, channels=2, hidden=spec.hidden, classes=5).to(spec.dtype)
        return model, torch.randn(b, 1, 8, 8, dtype=spec.dtype), torch.randint(0, 5, (b,))
    if spec.model == "residual":
        model = ResidualMLP(12, spec.hidden, 5, blocks=spec.layers).to(spec.dtype)
    else:
        model = mlp_stack(layers=spec.layers, hidden=spec.hidden, in_features=12, classes=5,
                          dtype=spec.dtype)
    return model, torch.randn(b, 12, dtype=spec.dtype), torch.randint(0, 5, (b,))


def _plan(model: nn.Module, x: torch.Tensor, spec: ParitySpec) -> Any:
    from hexagram.parallel.planner import plan

    world = dist.get_world_size()
    cluster = spec.cluster or Cluster(hosts=1, devices_per_host=world, dtype_bytes=8)
    box: list[Any] = [None]
    if dist.get_rank() == 0:  # one planner, so every rank applies the very same plan
        box[0] = plan(model, x, cluster, Constraints(**spec.constraints))
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _optimizer(spec: ParitySpec, params: Any) -> torch.optim.Optimizer:
    """SGD or Adam (elementwise state: sharded by ZeRO exactly like the parameters)."""
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=spec.lr)
    return torch.optim.SGD(params, lr=spec.lr)


def _local_elems(module: nn.Module) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel()
               for p in module.parameters())


def _devices(module: nn.Module) -> list[str]:
    """Where this rank's parameters (their local shards) live, e.g. ``["cuda:0"]``."""
    return sorted({str((p.to_local() if hasattr(p, "to_local") else p).device)
                   for p in module.parameters()})


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n].cpu() - b[n].cpu()).abs().max().item() for n in a)


def parity_worker(spec: ParitySpec) -> dict[str, Any]:
    """Train ``spec.steps`` steps planned and (optionally) unsharded; return the gaps."""
    from hexagram import runtime as hx  # init() only: the runtime, not the package root
    from hexagram.parallel.apply import default_loss, parallelize

    hx.init()
    model, x, y = build(spec)
    ref = build(spec)[0]
    ref.load_state_dict(model.state_dict())
    p = _plan(model, x, spec)
    pm = parallelize(model, p, example_inputs=x)
    opt = _optimizer(spec, pm.parameters())
    ref_opt = _optimizer(spec, ref.parameters())
    ref_params = dict(ref.named_parameters())
    out: dict[str, Any] = {"grad_diff": 0.0, "loss_diff": 0.0, "losses": [], "times": [],
                           "plan": p.to_json(indent=None), "stage": pm.stage_index,
                           "local_params": _local_elems(pm.module),
                           "param_devices": _devices(pm.module),
                           "stage_params": sum(q.numel() for q in pm.module.parameters())}
    for step in range(spec.steps):
        xs, ys = (x, y) if step == 0 else build(ParitySpec(**{
            **spec.__dict__, "seed": spec.seed + step}))[1:]
        dist.barrier()
        start = time.perf_counter()
        loss = pm.train_step(xs, ys)
        dist.barrier()
        out["times"].append(time.perf_counter() - start)
        if spec.reference:
            ref_loss = default_loss(ref(xs), ys)
            ref_loss.backward()
            grads = pm.full_gradients()
            ref_grads = {n: ref_params[n].grad for n in grads}
            out["grad_diff"] = max(out["grad_diff"], _diff(
                grads, {n: g for n, g in ref_grads.items() if g is not None}))
            if loss is not None:
                out["loss_diff"] = max(out["loss_diff"], abs(loss - ref_loss.item()))
            ref_opt.step()
            ref_opt.zero_grad()
        out["losses"].append(loss)
        opt.step()
        opt.zero_grad()
    if spec.reference:
        full = pm.full_parameters()
        out["param_diff"] = _diff(full, {n: ref_params[n].detach() for n in full})
    return out
