"""``hexagram.DistributedDataParallel``: a drop-in for PyTorch DDP with pluggable algorithms.

Example:
    >>> import hexagram as hx
    >>> hx.init()                                                   # doctest: +SKIP
    >>> model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm="allreduce")
    ... # doctest: +SKIP
    >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel.distributed import _to_kwargs
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from hexagram.algorithms import registry
from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.buckets import Bucket, build_buckets
from hexagram.comm import primitives
from hexagram.comm.communicator import Communicator
from hexagram.comm.device import control_tensor
from hexagram.engine import lifecycle, torch_args
from hexagram.engine.checks import (
    agree_finite_grads,
    at_end_of_backward,
    check_model_device,
    check_runs_on,
    check_same_model,
    fp16_autocast,
)
from hexagram.engine.comm_hooks import CommHooks
from hexagram.engine.eager import run_eagerly
from hexagram.engine.join import Joinable, default_group
from hexagram.engine.optimizers import expose_forward_signature, wrap_time_optimizers
from hexagram.engine.reducer import Reducer
from hexagram.engine.step_hooks import OptimizerHooks
from hexagram.errors import ConfigError
from hexagram.runtime import runtime_for_wrapping

__all__ = ["DistributedDataParallel"]

_MB = 1024 * 1024


def _run_module(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``module(*args, **kwargs)`` from a frame Dynamo compiles under ``torch.compile``.

    The wrapper's forward is skipped by Dynamo; a module called straight from it would start
    a frame in ``torch.nn`` (Dynamo's skip list: a ``nn.Sequential`` would run eagerly).
    This frame is Hexagram's, so Dynamo traces it and inlines the whole module.
    """
    return module(*args, **kwargs)


def _has_step_hooks(algorithm: Algorithm) -> bool:
    """True when ``algorithm`` acts at optimizer steps (a rank that skips one would fall
    out of step): local SGD, DiLoCo, decentralized; not the time-driven async averager."""
    kind = type(algorithm)
    return kind.after_step is not Algorithm.after_step \
        or kind.before_step is not Algorithm.before_step


class DistributedDataParallel(OptimizerHooks, CommHooks, Joinable, nn.Module):
    """Data-parallel wrapper whose communication is chosen by ``algorithm``.

    Takes every argument of ``torch.nn.parallel.DistributedDataParallel`` (torch 2.13), in
    its order, so a PyTorch DDP script runs with only its import changed; a process group
    the script made with ``torch.distributed.init_process_group`` is adopted (no
    ``hexagram.init()`` needed). Hexagram's own arguments are keyword-only.

    Args:
        module: the model (same architecture on every rank; checked at wrap time).
        device_ids: ``None`` (CPU modules, or inputs already on the device) or ``[d]``, the
            CUDA device holding the module: inputs are moved there before forward.
        output_device: ``None`` or ``device_ids[0]`` (accepted for torch's sake).
        dim: must be 0 (each rank passes its own batch; nothing is split).
        broadcast_buffers: torch's deprecated name of ``forward_sync_buffers``; False also
            skips the buffers at wrap time (as torch).
        init_sync: check that every rank holds the same model and broadcast rank 0's
            parameters and buffers at wrap time; False => the caller guarantees it.
        process_group: ``None`` or a group of every rank (Hexagram averages over all
            ranks; a subgroup raises ``ConfigError``).
        bucket_cap_mb: bucket capacity (MiB, default 25); larger => fewer, bigger
            messages; 0 => one tensor per bucket. ``bucket_size_mb`` is its alias.
        find_unused_parameters: allow parameters that get no gradient in some steps.
        check_reduction: deprecated in torch; no effect (FutureWarning).
        gradient_as_bucket_view: each ``.grad`` is a view of its bucket. **On by default
            in Hexagram (PyTorch's default is False)**: reduced gradients need no copy out
            of the buckets, and with ``zero_grad(set_to_none=False)`` backward accumulates
            straight into them. A ``.grad`` kept across a backward then changes with it;
            pass False for gradients of their own, as PyTorch's default.
        static_graph: a promise that the graph and its unused parameters never change:
            unused parameters are allowed (as ``find_unused_parameters=True``). A
            parameter that gets its gradient twice in one backward (reentrant
            checkpointing) is refused at that backward, with the fix.
        delay_all_reduce_named_params: not supported: anything but the default raises
            ``ConfigError`` naming the argument and what to do instead; the same holds for
            ``param_to_hook_all_reduce``, ``mixed_precision`` and
            ``skip_all_reduce_unused_params``.
        device_mesh: ``None`` or a 1-D mesh of every rank (as ``process_group``).
        bucket_cap_mb_list: ``[first, rest]`` MiB (the first bucket and all others).
        batched_grad_copy: a copy-scheduling hint of torch's reducer; no effect here.
        forward_sync_buffers: broadcast rank 0's buffers (e.g. BatchNorm statistics) before
            each forward (default True; gradient algorithms only).
        optimizers: optimizers of ``module``'s parameters (keyword); weight-based
            algorithms hook their ``step`` and need them: without, they raise
            ``ConfigError`` here; ``optimizers="later"`` defers them to
            :meth:`attach_optimizers` (before the first forward), for frameworks that create
            optimizers after wrapping. Framework wrappers (Accelerate's
            ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) are unwrapped.
        algorithm: a registered name (``hexagram.algorithms.names()``) or an instance from
            ``hexagram.algorithms.get(name, **config)`` (keyword; default "allreduce").
        first_bucket_mb: capacity of the first bucket (small, so communication starts early).

    Optimizers passed as the 2nd positional argument, or an algorithm as the 3rd (the
    former signature), still work with a ``FutureWarning``: pass them by keyword.

    After wrapping, parameters and buffers equal rank 0's. ``state_dict()`` has PyTorch
    DDP's keys (``module.`` prefix); ``load_state_dict`` also takes the module's own keys.
    ``no_sync()`` accumulates gradients locally. ``join()`` (or ``Join([model])``) lets
    ranks run out of data at different times. ``register_comm_hook`` runs PyTorch's
    built-in hooks as the matching algorithm. ``synchronize()`` brings every rank to the
    same weights (for delayed/decentralized algorithms). docs/migration.md maps every
    PyTorch DDP argument and method.

    Example::

        dist.init_process_group("gloo")          # or hexagram.init()
        model = hx.DistributedDataParallel(net, optimizers=[opt], algorithm="powersgd")
    """

    def __init__(self, module: nn.Module, device_ids: Any = None, output_device: Any = None,
                 dim: int = 0, broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: Any = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = True, static_graph: bool = False,
                 delay_all_reduce_named_params: Any = None,
                 param_to_hook_all_reduce: Any = None, mixed_precision: Any = None,
                 device_mesh: Any = None, skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: list[int] | None = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None, *, optimizers: Any = None,
                 algorithm: str | Algorithm | None = None, bucket_size_mb: float | None = None,
                 first_bucket_mb: float = 1.0) -> None:
        super().__init__()
        device_ids, output_device, optimizers, algorithm = torch_args.legacy_positionals(
            device_ids, output_device, optimizers, algorithm)
        runtime = runtime_for_wrapping(torch_args.module_device(module))
        given = {k: v for k, v in locals().items() if k in torch_args.ARGUMENTS}
        opts = torch_args.resolve(module, runtime.world_size, **given)
        check_runs_on(module, runtime.device)
        check_model_device(module, runtime.device)
        self.module = module
        self.algorithm = registry.get("allreduce" if algorithm is None else algorithm)
        self.optimizers = wrap_time_optimizers(optimizers, self.algorithm)
        self._algorithm_chosen = algorithm is not None
        self._comm_hook: Any = None  # register_comm_hook's, once
        self.process_group = default_group(process_group, device_mesh)
        self.runtime = runtime
        self.device_ids, self.output_device, self.dim = \
            opts.device_ids, opts.output_device, opts.dim
        self.static_graph = opts.static_graph
        self._input_device = opts.device
        self.find_unused_parameters = opts.find_unused_parameters
        self.broadcast_buffers = opts.forward_sync_buffers
        self.gradient_as_bucket_view = opts.gradient_as_bucket_view
        self._bucket_bytes = int(opts.bucket_mb * _MB)
        self._first_bucket_bytes = int(opts.first_bucket_mb * _MB)
        group = dist.new_group(list(range(runtime.world_size)), timeout=runtime.timeout)
        self.comm = Communicator(group, runtime.timeout, name=f"{self.algorithm.name}",
                                 owns_group=True)
        if opts.init_sync:
            check_same_model(module, group)
            self._broadcast(list(module.parameters())
                            + (list(module.buffers()) if opts.init_sync_buffers else []))
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._reducer: Reducer | None = None
        self._rebucketed = False
        self._sync = True  # False inside no_sync()
        # released by close(), garbage collection or interpreter exit (no close() needed)
        self._resources = lifecycle.Resources(self.algorithm, self.comm)
        self._finalizer = lifecycle.attach(self, self._resources)
        self._ctx = AlgorithmContext(module, self.optimizers, runtime, self.comm, self._named)
        self._step_hooks: list[Any] = []
        self._hooked: set[int] = set()
        self._amp = False  # the last forward ran under fp16 autocast
        self._grad_scale = 1.0  # join(divide_by_initial_world_size=False) sets it
        self._build()  # wires where the step's checks are read (see _wire_checks)
        self._setup_pending = True
        self.attach_optimizers(*self.optimizers)
        expose_forward_signature(self, module)
        self._divide_by_world = True  # join's divide_by_initial_world_size

    # -- set-up helpers ------------------------------------------------------------------
    def _broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        with torch.no_grad():
            primitives.broadcast(self.comm, [t.data for t in tensors], src=src).wait()

    def _build(self, order: Sequence[tuple[str, nn.Parameter]] | None = None) -> None:
        """(Re)build buckets over the algorithm's tensors, and gradient hooks if it needs them."""
        if self._reducer is not None:
            self._reducer.remove()
            self._reducer = None
        named = list(order) if order is not None else self.algorithm.tensors(self._named)
        wanted = self.algorithm.bucket_size_bytes()  # None: the wrapper's bucket_size_mb
        cap = self._bucket_bytes if wanted is None else int(wanted)
        buckets = build_buckets(named, cap, min(self._first_bucket_bytes, cap)) \
            if named else []
        self._ctx.buckets = buckets
        if self.algorithm.kind == "grad" and buckets:
            self._reducer = Reducer(self.algorithm, self.comm, buckets,
                                    self.find_unused_parameters, self.gradient_as_bucket_view)
            self._reducer.enabled = self._sync
            self._reducer.grad_scale = self._grad_scale  # join's, for the next backward
        self._resources.reducer = self._reducer
        self._wire_checks()

    def _rebucket_by_ready_order(self) -> None:
        """After the first backward, order buckets as gradients actually became ready.

        Rank 0's order is broadcast so that every rank builds identical buckets.
        """
        self._rebucketed = True
        reducer = self._reducer
        if reducer is None or not reducer.ready_order:
            return
        index = {n: i for i, (n, _) in enumerate(self._named)}
        seen = [index[n] for n in reducer.ready_order if n in index]
        rest = [i for i in range(len(self._named)) if i not in set(seen)]
        order = control_tensor(seen + [i for i in reversed(rest)], self.comm)
        primitives.broadcast(self.comm, [order], src=0).wait()
        new = [self._named[i] for i in order.tolist()]
        current = [(e.name, e.param) for b in reducer.buckets for e in b.entries]
        if [n for n, _ in new] != [n for n, _ in current]:
            self._build(order=new)
            self.algorithm.reset(self._ctx)

    # -- training-time hooks -----------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The engine's pre-forward work (eager), then the wrapped module's forward. Under
        # torch.compile(wrapper) this frame runs eagerly, as PyTorch DDP's forward does, and
        # the module's forward is compiled whole (no graph break from the engine: its
        # collectives, locks and hook bookkeeping never reach Dynamo); gradients then arrive
        # together at the end of the compiled backward, so buckets launch after it. (No
        # docstring: the exposed forward shows the wrapped module's.)
        self._before_module_forward()
        if self._input_device is not None:  # device_ids=[d]: inputs go to d, as torch's
            args, kwargs = torch_args.to_device((args, kwargs), self._input_device)
        output = _run_module(self.module, args, kwargs)
        amp = self._amp = fp16_autocast(self.runtime.device.type)
        if self._reducer is not None and self._reducer.guard is not None:  # ranks agree?
            self._reducer.guard.collective = amp or \
                getattr(self.algorithm.config, "on_nonfinite", "raise") == "skip"
        if self.algorithm.kind == "weight" and self.comm.size > 1 and torch.is_grad_enabled() \
                and _has_step_hooks(self.algorithm) and amp:  # keep GradScalers in step
            at_end_of_backward(output, lifecycle.weak_method(self._agree_finite_grads))
        return output

    def _agree_finite_grads(self) -> None:
        agree_finite_grads(self.comm, [p for _, p in self._named])

    def _before_module_forward(self) -> None:
        if self._join_config.enable:  # inside Join([model]) / model.join()
            self._notify_join(syncing=torch.is_grad_enabled() and (
                self._reducer is None or self._reducer.enabled))
        if self._setup_pending:
            raise ConfigError(
                f"algorithm {self.algorithm.name!r} communicates after optimizer steps: pass "
                "optimizers=[opt] to hexagram.DistributedDataParallel or call "
                "model.attach_optimizers(opt) before the first forward")
        if torch.is_grad_enabled() and self._ctx.checks.deferred:
            # a step whose optimizer.step() never ran (a GradScaler skipped it: its Inf was
            # already handled) leaves its queued checks behind: they are not this step's
            self._ctx.checks.clear()
        self._prepare_forward()

    forward = run_eagerly(forward, recursive=False)
    _before_module_forward = run_eagerly(_before_module_forward, recursive=True)

    def _prepare_forward(self, joined: bool = False) -> None:
        """The collectives and hooks that precede every forward (also shadowed by joined
        ranks, ``joined=True``, so they must stay identical on every rank)."""
        if self.algorithm.need_reset():
            self._build()
            self.algorithm.reset(self._ctx)
        elif not self._rebucketed and self._reducer is not None \
                and self._reducer.backward_count > 0:
            self._rebucket_by_ready_order()
        if self._reducer is not None:  # auto's choice may have changed what it needs
            self._reducer.match_guard()
        # Weight algorithms let replicas diverge between rounds (and ranks may finish their
        # data at different times), so a per-forward broadcast would block finished peers.
        if self.broadcast_buffers and self.runtime.world_size > 1 \
                and self.algorithm.kind == "grad":
            buffers = list(self.module.buffers())
            if buffers:
                self._broadcast(buffers, src=self._buffer_source(joined))
        self.algorithm.before_forward()

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> Any:
        """Read by ``torch.nn.parallel.DistributedDataParallel`` at wrap time: refuse to be
        wrapped twice (both wrappers would communicate every gradient)."""
        raise ConfigError(
            "this model is already wrapped by hexagram.DistributedDataParallel; do not wrap "
            "it again in torch.nn.parallel.DistributedDataParallel (e.g. accelerator.prepare("
            "model), Lightning's DDPStrategy): prepare everything but the model (see "
            "hexagram.integrations.accelerate.prepare) or use HexagramStrategy")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside do not communicate."""
        # the flag belongs to the wrapper: a reducer rebuilt inside the block (re-bucketing
        # after the first backward) must start disabled too
        previous, self._sync = self._sync, False
        if self._reducer is not None:
            self._reducer.enabled = False
        try:
            yield
        finally:
            self._sync = previous
            if self._reducer is not None:
                self._reducer.enabled = previous

    # -- PyTorch DDP's helpers, kept for scripts that call them ---------------------------
    def will_sync_module_buffers(self) -> bool:
        """True when rank 0's buffers are broadcast before each forward (as PyTorch's)."""
        return self.broadcast_buffers and self.algorithm.kind == "grad" \
            and self.runtime.world_size > 1 and any(True for _ in self.module.buffers())

    def to_kwargs(self, inputs: Any, kwargs: Any, device_id: int) -> Any:
        """PyTorch DDP's: inputs and kwargs moved to CUDA device ``device_id``."""
        return _to_kwargs(inputs, kwargs, torch.device("cuda", device_id), False)

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[int]) -> Any:
        """PyTorch DDP's: ``scatter_kwargs(inputs, kwargs, device_ids, dim)``."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def gather(self, outputs: Any, output_device: Any) -> Any:
        """PyTorch DDP's: ``gather(outputs, output_device, dim)``."""
        return gather(outputs, output_device, dim=self.dim)

    # -- user-facing utilities -----------------------------------------------------------
    @property
    def buckets(self) -> list[Bucket]:
        """Current buckets, in launch order."""
        return list(self._ctx.buckets)

    def synchronize(self) -> None:
        """Bring every rank to the same averaged weights (collective)."""
        self.algorithm.synchronize()

    def bytes_sent(self) -> int:
        """Bytes this rank has sent for the algorithm since wrapping (wrap-time broadcast
        excluded)."""
        return self.algorithm.bytes_sent() - self.comm.counter.by_op().get("broadcast", 0)

    def load_state_dict(self, state_dict: Any, strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a state dict with PyTorch DDP's keys (``module.weight``: what
        ``state_dict()`` returns, here and under PyTorch DDP), or with the module's own keys
        (``weight``: a plain module's checkpoint, or one from Hexagram before it took
        PyTorch's keys), which go to the wrapped module as they are (the reverse of
        ``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present``)."""
        if torch_args.has_bare_keys(state_dict, self.module):
            return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def algorithm_state_dict(self) -> dict[str, Any]:
        """The algorithm's state (residuals, momenta, counters) for exact resumption."""
        return self.algorithm.state_dict()

    def load_algorithm_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`algorithm_state_dict`."""
        self.algorithm.load_state_dict(state)

    def close(self) -> None:
        """Stop background work, detach hooks and let go of the engine's buffers; the
        module stays usable locally.

        After ``close()`` the wrapper holds no buckets, reducer, pending handles or
        non-finite check, and the algorithm sees no buckets, so their device memory is
        freed even while the wrapper object lives on (``bytes_sent()`` still answers);
        the module's parameters and the optimizers stay the user's. Nothing refers to the
        wrapper from a hook, so ``del model`` frees it at once, closed or not.

        Optional: the same happens, quietly, when the wrapper is garbage-collected or the
        interpreter exits (see :mod:`hexagram.engine.lifecycle`). Idempotent."""
        self._finalizer.detach()
        try:
            self._resources.release()
        finally:
            self._reducer = None
            self._ctx.buckets = []
