"""Exact, collective checkpoints on ``torch.distributed.checkpoint`` (DCP).

``save_checkpoint(directory, model, optimizers, step=step)`` writes, for every rank, the
module, the optimizers, the algorithm state (``model.algorithm_state_dict()``: residuals,
warm-start factors, RNG states, DiLoCo's outer optimizer...), the global RNG states and
``extra`` into ``directory/step_<step>/`` as one DCP checkpoint (keys ``r<rank>/...``, so
replicas that differ between averaging rounds are kept exactly), then rank 0 *commits* it
by atomically writing ``hexagram_commit.json``. A step without that file (a rank died while
writing) is invisible to :func:`load_checkpoint`, so it is never half-loaded.

``load_checkpoint(directory, model, optimizers)`` finds the newest step committed in every
rank's view of ``directory``, checks that it fits (same model, optimizers, algorithm and
config), reads it with DCP, and only then loads it into the live objects; any error on any
rank is raised on every rank (never a hang), and live objects are rolled back.

Example:
    >>> step = hx.load_checkpoint("ckpt", model, [opt]) or 0      # doctest: +SKIP
    >>> for step in range(step, total):                           # doctest: +SKIP
    ...     train_one_step(step)
    ...     if (step + 1) % 100 == 0:
    ...         hx.save_checkpoint("ckpt", model, [opt], step=step + 1)
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from hexagram.elastic.reshard import merge_states
from hexagram.elastic.state import (
    CheckpointError,
    apply_rank_state,
    collect_rank_state,
    fingerprint,
    flatten,
    unflatten,
)

__all__ = ["CheckpointError", "committed_steps", "load_checkpoint", "save_checkpoint"]

COMMIT = "hexagram_commit.json"
FORMAT = "hexagram-checkpoint/1"
T = TypeVar("T")
_log = logging.getLogger(__name__)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (collective; a list of one without a process group)."""
    world = _rank_world()[1]
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _agree(what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it failed anywhere, raise on every rank (no hang)."""
    try:
        value, error = fn(), None
    except Exception as exc:  # reported to every rank below
        value, error = None, f"{type(exc).__name__}: {exc}"
    gathered = _collective(what, lambda: _gather(error))
    errors = [(r, e) for r, e in enumerate(gathered) if e is not None]
    if errors:
        detail = "; ".join(f"rank {r}: {e}" for r, e in errors)
        raise CheckpointError(f"{what} failed on {len(errors)} rank(s): {detail}")
    return value  # type: ignore[return-value]


def _collective(what: str, fn: Callable[[], T]) -> T:
    """Run a collective; a peer that died or timed out becomes a CheckpointError."""
    try:
        return fn()
    except CheckpointError:
        raise
    except (RuntimeError, TimeoutError, CheckpointException) as exc:  # gloo/NCCL, DCP errors
        raise CheckpointError(f"{what}: a peer rank failed or stopped answering ({exc}); "
                              "nothing was committed or loaded") from exc


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:010d}"


def _same_directory(directory: str | os.PathLike[str], what: str) -> Path:
    root = Path(directory).expanduser().resolve()
    seen = _collective(what, lambda: _gather(str(root)))
    if len(set(seen)) > 1:
        listing = ", ".join(f"rank {r}: {d}" for r, d in enumerate(seen))
        raise CheckpointError(f"{what}: ranks point at different checkpoint directories "
                              f"({listing}); pass the same shared directory on every rank")
    return root


def committed_steps(directory: str | os.PathLike[str]) -> dict[int, str]:
    """``{step: token}`` of the committed checkpoints in ``directory`` (this rank's view)."""
    out: dict[int, str] = {}
    root = Path(directory)
    if not root.is_dir():
        return out
    for marker in root.glob(f"step_*/{COMMIT}"):
        try:
            manifest = json.loads(marker.read_text())
            out[int(manifest["step"])] = str(manifest["token"])
        except (OSError, ValueError, KeyError):
            continue  # unreadable marker: treat the step as not committed
    return out


def _commit(path: Path, manifest: dict[str, Any]) -> None:
    tmp = path / f".{COMMIT}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / COMMIT)  # atomic: the step is committed or it is not


def _discard(path: Path) -> None:
    (path / COMMIT).unlink(missing_ok=True)  # uncommit first: never a half-deleted step
    shutil.rmtree(path, ignore_errors=True)


def _barrier() -> None:
    if _rank_world()[1] > 1:
        _collective("final barrier", dist.barrier)


def save_checkpoint(directory: str | os.PathLike[str], model: nn.Module,
                    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
                    *, step: int, extra: Any = None, keep: int | None = None) -> Path:
    """Save every rank's state as step ``step`` (collective; see the module doc).

    Args:
        directory: the same (shared) directory on every rank.
        model: a :class:`hexagram.DistributedDataParallel` (its algorithm state is saved)
            or any ``nn.Module``.
        optimizers: the optimizers to save, in the order :func:`load_checkpoint` gets them.
        step: the training step this state is *after*; ``load_checkpoint`` returns it.
        extra: small picklable per-rank data (data-loader position, metrics...).
        keep: keep only the newest ``keep`` committed steps (None: keep all).

    Returns:
        The step's directory. Raises :class:`CheckpointError` on every rank if any failed.
    """
    opts = _as_list(optimizers)
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep must be >= 1 (or None to keep all), got {keep}")
    rank, world = _rank_world()
    root = _same_directory(directory, "save_checkpoint")
    path = _step_dir(root, step)
    if rank == 0:
        _agree("preparing the checkpoint directory", lambda: _prepare(path))
    else:
        _agree("preparing the checkpoint directory", lambda: None)
    flat = flatten(collect_rank_state(model, opts, step, extra), rank)
    _collective(f"writing step {step}",
                lambda: dcp.save(flat, checkpoint_id=str(path), no_dist=world == 1))
    manifest = {"format": FORMAT, "step": int(step), "world_size": world,
                "token": uuid.uuid4().hex, "time": time.time(),
                "fingerprint": fingerprint(model, opts)}
    _agree(f"confirming step {step} on every rank", lambda: None)  # all alive: commit
    _agree("committing the checkpoint",
           lambda: _commit(path, manifest) if rank == 0 else None)
    if keep is not None and rank == 0:
        for old in sorted(committed_steps(root))[:-keep]:
            _discard(_step_dir(root, old))
    _barrier()
    return path


def _prepare(path: Path) -> None:
    if path.exists():
        _discard(path)  # an earlier, possibly partial, save of the same step
    path.mkdir(parents=True)


def _as_list(optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer
             ) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers)


def _newest_common(views: list[dict[int, str]], step: int | None) -> int | None:
    """The newest step every rank sees committed (with the same token), or ``step``."""
    common = set(views[0])
    for r, view in enumerate(views[1:], start=1):
        for s in set(view) & common:
            if view[s] != views[0][s]:
                raise CheckpointError(
                    f"rank {r} and rank 0 see different checkpoints for step {s}: their "
                    "directories are not the same storage; use one shared directory")
        common &= set(view)
    if step is not None:
        if step not in common:
            raise CheckpointError(f"step {step} is not committed on every rank; committed on "
                                  f"all: {sorted(common) or 'none'}")
        return step
    return max(common) if common else None


def _check_fits(manifest: dict[str, Any], mine: dict[str, Any], world: int,
                allow_resize: bool) -> None:
    saved = manifest.get("fingerprint", {})
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"not a {FORMAT} checkpoint (format {manifest.get('format')!r})")
    for field, what in (("algorithm", "algorithm"), ("algorithm_config", "algorithm config"),
                        ("optimizers", "optimizers (type, parameters per group)")):
        if field == "algorithm_config" and " at 0x" in str(mine[field]):
            continue  # holds objects whose repr is an address: not comparable across jobs
        if saved.get(field) != mine[field]:
            raise CheckpointError(f"checkpoint was saved with {what} {saved.get(field)!r}, "
                                  f"this job has {mine[field]!r}; resume with the same {what}")
    ours = {k: (shape, dtype) for k, shape, dtype in mine["model"]}
    theirs = {k: (shape, dtype) for k, shape, dtype in saved.get("model", [])}
    for key in list(ours) + [k for k in theirs if k not in ours]:  # model order
        if ours.get(key) != theirs.get(key):
            raise CheckpointError(
                f"checkpoint is of another model: entry {key!r} is {theirs.get(key)} in the "
                f"checkpoint and {ours.get(key)} in this model (None = missing)")
    if manifest["world_size"] != world and not allow_resize:
        raise CheckpointError(f"checkpoint was saved by {manifest['world_size']} ranks, this "
                              f"job has {world}; pass allow_world_size_change=True to fold "
                              "per-rank state (see docs/elastic.md)")


def _read(path: Path, ranks: list[int]) -> dict[str, torch.Tensor]:
    """Read the flat entries of ``ranks`` (collective: DCP plans across all ranks)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    prefixes = tuple(f"r{r}/" for r in ranks)
    flat: dict[str, torch.Tensor] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefixes):
            if not isinstance(md, dcp.metadata.TensorStorageMetadata):
                raise CheckpointError(f"checkpoint entry {key!r} is not a tensor")
            flat[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    missing = [r for r in ranks if f"r{r}/__structure__" not in flat]
    if missing:
        raise CheckpointError(f"checkpoint {path} holds no state of rank(s) {missing}")
    return flat


def _my_state(path: Path, manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    old_world, world = int(manifest["world_size"]), _rank_world()[1]
    ranks = [rank] if old_world == world else list(range(old_world))
    skeleton = _agree("reading the checkpoint's metadata", lambda: _read(path, ranks))
    _collective(f"reading {path}",
                lambda: dcp.load(skeleton, checkpoint_id=str(path), no_dist=world == 1))
    if old_world == world:
        return _agree("unpacking the checkpoint",  # type: ignore[no-any-return]
                      lambda: unflatten(skeleton, rank))
    state, notes = _agree(f"folding {old_world} ranks' state into {world}", lambda: merge_states(
        [unflatten(skeleton, r) for r in ranks], rank))
    if rank == 0:
        _log.warning("resuming %d-rank checkpoint on %d ranks: folded (mean over ranks) %s; "
                     "taken from the same rank %s", old_world, world, notes["folded"],
                     notes["per_rank"])
    return state


def load_checkpoint(directory: str | os.PathLike[str], model: nn.Module,
                    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
                    *, step: int | None = None, extra: dict[str, Any] | None = None,
                    restore_rng: bool = True, allow_world_size_change: bool = False
                    ) -> int | None:
    """Load the newest step committed for every rank (collective); None if there is none.

    Args:
        directory, model, optimizers: as given to :func:`save_checkpoint`.
        step: load this step instead of the newest (must be committed for every rank).
        extra: if given, a dict updated with ``{"extra": <what this rank saved>}``.
        restore_rng: also restore torch's and Python's global RNG of this rank.
        allow_world_size_change: resume a checkpoint of another number of ranks by folding
            per-rank state (see :mod:`hexagram.elastic.reshard`); False => error.

    Returns:
        The saved ``step``, or None (nothing loaded) when no step is committed everywhere.

    Raises:
        CheckpointError: on every rank, naming the mismatch (another model, algorithm,
            config or world size; ranks on different directories; unreadable data). The
            live objects are rolled back: a checkpoint is loaded whole or not at all.
    """
    opts = _as_list(optimizers)
    rank, world = _rank_world()
    root = _same_directory(directory, "load_checkpoint")
    chosen = _agree("finding committed steps",
                    lambda: _newest_common(_gather(committed_steps(root)), step))
    if chosen is None:
        return None
    path = _step_dir(root, chosen)

    def check() -> dict[str, Any]:
        manifest: dict[str, Any] = json.loads((path / COMMIT).read_text())
        _check_fits(manifest, fingerprint(model, opts), world, allow_world_size_change)
        return manifest

    manifest = _agree(f"checking checkpoint step {chosen}", check)
    state = _my_state(path, manifest, rank)
    _apply_all_or_nothing(state, model, opts, restore_rng, chosen)
    if extra is not None:
        extra["extra"] = state.get("extra")
    return int(state["step"])


def _apply_all_or_nothing(state: dict[str, Any], model: nn.Module,
                          opts: list[torch.optim.Optimizer], restore_rng: bool,
                          step: int) -> None:
    backup = copy.deepcopy(collect_rank_state(model, opts, step, None))
    try:
        _agree(f"loading step {step} into the model, optimizers and algorithm",
               lambda: apply_rank_state(state, model, opts, restore_rng))
    except CheckpointError:
        apply_rank_state(backup, model, opts, restore_rng=False)  # roll back
        raise
