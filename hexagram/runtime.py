"""Process-group set-up from torchrun's environment, backend choice, timeouts, topology.

``hexagram.init()`` reads the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), picks NCCL when CUDA is present and
gloo otherwise, and learns which ranks share a host. Run without torchrun, it starts a
single-process group, so the same script works with world size 1.

Restarts: under ``torchrun --max-restarts N`` every attempt sets up its process group under
its own store prefix (``TORCHELASTIC_RESTART_COUNT``), so restarted workers never read the
addresses of the attempt that died, and the set-up has a deadline (``init_timeout``): a rank
that never arrives makes the others raise :class:`InitTimeoutError` naming it, never hang.
See ``hexagram.rendezvous`` and docs/elastic.md.

Example:
    >>> import hexagram as hx
    >>> rt = hx.init()          # doctest: +SKIP
    >>> rt.rank, rt.world_size, rt.hosts  # doctest: +SKIP
    (0, 1, [[0]])
"""

from __future__ import annotations

import atexit
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from hexagram.errors import ConfigError, NotInitializedError
from hexagram.rendezvous import (
    InitTimeoutError,
    attempt_store,
    call_with_deadline,
    wait_for_all,
)

__all__ = ["DEFAULT_TIMEOUT", "InitTimeoutError", "Runtime", "adopt_group", "get_runtime",
           "init", "is_initialized", "runtime_for_wrapping", "shutdown"]

#: Default for every collective: far below torch's 30 minutes, so a dead peer is noticed.
DEFAULT_TIMEOUT = timedelta(seconds=120)

_RUNTIME: Runtime | None = None
_GENERATION = 0  # hexagram.init calls that built a group in this process (store key space)


@dataclass
class Runtime:
    """What this process knows about the job.

    Attributes:
        rank, world_size: global rank and number of ranks.
        local_rank, local_world_size: index on this host and ranks on this host.
        backend: ``"gloo"`` or ``"nccl"``.
        device: where tensors of this rank live (``cuda:<local_rank>`` or ``cpu``).
        timeout: limit of every collective.
        host_of_rank: host index of every global rank.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    timeout: timedelta
    host_of_rank: list[int]
    _groups: dict[str, object] = field(default_factory=dict, repr=False)
    #: the default process group this runtime describes (a new one needs a new runtime)
    world_group: object = field(default=None, repr=False, compare=False)

    @property
    def hosts(self) -> list[list[int]]:
        """Global ranks grouped by host, hosts in order of their lowest rank."""
        by_host: dict[int, list[int]] = {}
        for r, h in enumerate(self.host_of_rank):
            by_host.setdefault(h, []).append(r)
        return sorted(by_host.values(), key=lambda ranks: ranks[0])

    def host_groups(self) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """(group of the ranks on my host, group of host leaders or None if not a leader).

        Collective: every rank must call it (the first call creates the groups in the same
        order everywhere). Leaders are the lowest rank of each host.
        """
        if "intra" not in self._groups:
            intra = leaders = None
            for ranks in self.hosts:  # new_group must be called by all ranks, in order
                g = dist.new_group(ranks, timeout=self.timeout)
                if self.rank in ranks:
                    intra = g
            leader_ranks = [ranks[0] for ranks in self.hosts]
            lg = dist.new_group(leader_ranks, timeout=self.timeout)
            if self.rank in leader_ranks:
                leaders = lg
            self._groups["intra"], self._groups["leaders"] = intra, leaders
        return self._groups["intra"], self._groups["leaders"]  # type: ignore[return-value]

    def new_group(self, name: str) -> dist.ProcessGroup:
        """A new group of all ranks (collective), e.g. for a background averaging thread."""
        group = dist.new_group(list(range(self.world_size)), timeout=self.timeout)
        self._groups[name] = group
        return group


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer") from None


def _as_timedelta(timeout: float | timedelta) -> timedelta:
    td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if td.total_seconds() <= 0:
        raise ConfigError(f"timeout must be positive, got {td.total_seconds()} s")
    return td


def _choose_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend must be 'gloo' or 'nccl' (or None to choose), got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend='nccl' needs CUDA, which is not available; use 'gloo'")
    return backend


def _choose_device(backend: str, device: str | torch.device | None,
                   local_rank: int) -> torch.device:
    """The rank's device: the default for ``backend``, or ``device`` checked against it."""
    if device is None:
        return torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
    chosen = torch.device(device)
    if chosen.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if chosen.type == "cpu":
        if backend == "nccl":
            raise ConfigError("backend='nccl' needs device='cuda'; use backend='gloo' on the CPU")
        return chosen
    if not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} needs CUDA, which is not available; use "
                          "device='cpu' (or leave it out)")
    index = chosen.index if chosen.index is not None \
        else local_rank % torch.cuda.device_count()
    return torch.device("cuda", index)


def _host_key() -> str:
    # GROUP_RANK is torchrun's node rank; the network lab sets HEXAGRAM_HOST for namespaces
    # (which share the machine's hostname).
    return os.environ.get("HEXAGRAM_HOST") or os.environ.get("GROUP_RANK") or socket.gethostname()


def _init_group(backend: str, rank: int, world: int, timeout: timedelta,
                init_timeout: timedelta) -> None:
    """The default process group, on this attempt's store, within ``init_timeout``."""
    global _GENERATION
    if world == 1 and "MASTER_ADDR" not in os.environ:
        store: dist.Store = dist.HashStore()  # single process: no rendezvous needed
    else:
        store = attempt_store(rank, world, init_timeout, generation=_GENERATION)
        wait_for_all(store, rank, world, init_timeout)
    _GENERATION += 1

    def connect() -> None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)

    call_with_deadline(connect, init_timeout, f"init_process_group({backend!r}) of rank {rank}")


def init(backend: str | None = None, timeout: float | timedelta = DEFAULT_TIMEOUT,
         init_timeout: float | timedelta | None = None,
         device: str | torch.device | None = None) -> Runtime:
    """Initialise torch.distributed from torchrun's environment (idempotent).

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``None`` (NCCL with CUDA, gloo otherwise).
        device: where this rank's tensors live; ``None``: ``cuda:<local_rank>`` with NCCL,
            the CPU with gloo. ``init(backend="gloo", device="cuda")`` runs several ranks
            with CUDA tensors over gloo, on one GPU if need be (``cuda:<local_rank % GPUs>``):
            multi-rank device bugs show on a one-GPU machine (gloo refuses a few
            collectives on CUDA, see ``hexagram.comm.device.GLOO_CUDA_REFUSES``).
        timeout: seconds (or timedelta) any collective may take before a timeout error.
        init_timeout: deadline of the set-up (store, arrival of every rank, connections);
            ``None`` => ``timeout``. Shorter => a failed restart attempt is noticed sooner.

    Returns:
        The :class:`Runtime` of this process.

    Raises:
        InitTimeoutError: set-up did not complete in time (names the ranks that never came).
    """
    global _RUNTIME
    if _RUNTIME is not None:
        _check_same_request(_RUNTIME, backend, device)
        return _RUNTIME
    td = _as_timedelta(timeout)
    init_td = td if init_timeout is None else _as_timedelta(init_timeout)
    chosen = _choose_backend(backend)
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", 1)
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    device = _choose_device(chosen, device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        _init_group(chosen, rank, world, td, init_td)
    keys: list[str | None] = [None] * world
    dist.all_gather_object(keys, _host_key())
    host_index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    _RUNTIME = Runtime(rank=rank, world_size=world, local_rank=local_rank,
                       local_world_size=local_world, backend=chosen, device=device, timeout=td,
                       host_of_rank=[host_index[k] for k in keys], world_group=dist.group.WORLD)
    _settle_at_exit()
    return _RUNTIME


def _check_same_request(live: Runtime, backend: str | None,
                        device: str | torch.device | None) -> None:
    """``init()`` again is a no-op only if it asks for what is running: a different backend
    or device cannot be had without tearing the process group down, so say so."""
    if backend is not None and backend != live.backend:
        raise ConfigError(
            f"hexagram.init(backend={backend!r}): this process already runs {live.backend!r} "
            "(an earlier init() or the adopted process group); call hexagram.shutdown() "
            "first, or drop the backend argument to reuse it")
    if device is not None and torch.device(device).type != live.device.type:
        raise ConfigError(
            f"hexagram.init(device={str(device)!r}): this process already communicates on "
            f"{live.device}; call hexagram.shutdown() first, or drop the device argument")


def _adopted_backend() -> str:
    """``"nccl"`` or ``"gloo"`` for the default group (``init_process_group()`` without a
    backend reports ``"undefined"``; its configuration reads ``"cpu:gloo,cuda:nccl"``)."""
    config = str(dist.get_backend_config())
    return "nccl" if "nccl" in config and torch.cuda.is_available() else "gloo"


def adopt_group(timeout: float | timedelta = DEFAULT_TIMEOUT,
                device: torch.device | None = None) -> Runtime:
    """Replace the runtime by one for the default process group set up elsewhere.

    For a script that called ``torch.distributed.init_process_group`` itself (the wrapper
    adopts its group: :func:`runtime_for_wrapping`), and for live mode
    (``hexagram.elastic.live``), which rebuilds the default gloo group for every new
    membership. Rank and world size come from the group, the local rank and size from
    torchrun's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (0 and 1 without them); ``device``
    defaults to ``cuda:LOCAL_RANK`` for NCCL, the CPU otherwise. Collective: host keys are
    gathered. Example: ``dist.init_process_group("gloo", store=..., rank=r, world_size=w);
    hexagram.runtime.adopt_group(30)``.
    """
    global _RUNTIME
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = _adopted_backend()
    local_rank = _env_int("LOCAL_RANK", 0)
    if device is None:
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    keys: list[str | None] = [None] * world
    dist.all_gather_object(keys, _host_key())
    host_index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    _RUNTIME = Runtime(rank=rank, world_size=world, local_rank=local_rank,
                       local_world_size=_env_int("LOCAL_WORLD_SIZE", 1), backend=backend,
                       device=device, timeout=_as_timedelta(timeout),
                       host_of_rank=[host_index[k] for k in keys], world_group=dist.group.WORLD)
    _settle_at_exit()
    return _RUNTIME


def runtime_for_wrapping(device: torch.device | None = None) -> Runtime:
    """The runtime for a wrapper being built (collective when it adopts a group).

    :func:`init`'s runtime; or, in a script that set up the default process group itself
    (``torch.distributed.init_process_group``, as a PyTorch DDP script does), a runtime
    adopted from that group (:func:`adopt_group`, ``device``: the model's, used with
    NCCL), so ``hexagram.DistributedDataParallel`` replaces PyTorch's with only the
    import changed. A group re-created since is adopted anew.

    Raises:
        NotInitializedError: no process group at all (names both ways to make one).
    """
    if not dist.is_initialized():
        return get_runtime()
    if _RUNTIME is not None and _RUNTIME.world_group is dist.group.WORLD:
        return _RUNTIME
    use = device if device is not None and device.type == "cuda" \
        and _adopted_backend() == "nccl" else None
    return adopt_group(DEFAULT_TIMEOUT, device=use)


def is_initialized() -> bool:
    """True after :func:`init`."""
    return _RUNTIME is not None


def get_runtime() -> Runtime:
    """The runtime set up by :func:`init`; a clear error if it was not called."""
    if _RUNTIME is None:
        raise NotInitializedError(
            "Hexagram is not initialised: call hexagram.init() first (it reads torchrun's "
            "environment; launch with `torchrun --nproc-per-node N script.py`, or run the "
            "script plainly for world size 1), or torch.distributed.init_process_group() "
            "as a PyTorch DDP script does (the wrapper adopts that group)"
        )
    return _RUNTIME


#: seconds the interpreter leaves the GIL free at exit while a process group is still up
SETTLE_S = 0.1
_SETTLE_REGISTERED = False


def settle_collective_workers() -> None:
    """Release the GIL for a moment so collective worker threads finish before finalisation.

    A gloo worker thread drops its last reference to a finished collective just after
    ``wait()`` returns; if that destructor takes the GIL once the interpreter is
    finalising, the thread is ended by ``pthread_exit`` inside a ``noexcept`` destructor:
    SIGABRT, ``terminate called without an active exception`` (a core dump showed
    ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` -> ``decref_pyobject`` ->
    ``take_gil``). A script that ends with its process group up (no ``shutdown()``, as
    most torchrun scripts) gets this pause from an ``atexit`` handler, before finalisation.
    """
    time.sleep(SETTLE_S)


def _settle_at_exit() -> None:
    global _SETTLE_REGISTERED
    if not _SETTLE_REGISTERED:
        _SETTLE_REGISTERED = True
        atexit.register(lambda: settle_collective_workers() if dist.is_initialized() else None)


def shutdown() -> None:
    """Barrier, then destroy the process group (a barrier first avoids peers aborting)."""
    global _RUNTIME
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    _RUNTIME = None
