"""``hexagram.DistributedDataParallel`` takes PyTorch DDP's arguments: a DDP script runs with
only its import changed (its own ``init_process_group`` adopted), and ends with the same
parameters as under PyTorch DDP; arguments that cannot apply are refused by name."""

from __future__ import annotations

import inspect
import runpy
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import hexagram as hx
from hexagram.engine import torch_args
from hexagram.errors import ConfigError
from hexagram.launch import run_local

HEXAGRAM_ONLY = ("optimizers", "algorithm", "bucket_size_mb", "first_bucket_mb")

# A plain PyTorch DDP script, as a user writes it (torch's own positional arguments).
SCRIPT = '''
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main(out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different on each rank: the wrapper broadcasts rank 0's
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model = DDP(net, None, None, 0, bucket_cap_mb=0.001, init_sync=True,
                find_unused_parameters=False, static_graph=False, forward_sync_buffers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(8):
        x, y = torch.randn(12, 8, generator=gen), torch.randint(0, 3, (12,), generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save(model.module.state_dict(), f"{out}.{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
'''
HEXAGRAM_IMPORT = "from hexagram import DistributedDataParallel as DDP"


def _run_script(path: str, out: str) -> None:
    sys.argv = [path, out]
    runpy.run_path(path, run_name="__main__")


def test_signature_is_torch_ddps_in_order_with_hexagram_keywords_after() -> None:
    theirs = inspect.signature(TorchDDP.__init__).parameters
    ours = inspect.signature(hx.DistributedDataParallel.__init__).parameters
    assert list(ours)[:len(theirs)] == list(theirs)  # positional order: module, device_ids,..
    assert list(ours)[2] == "device_ids"
    for name, param in theirs.items():
        assert ours[name].kind == param.kind, name
        if name != "gradient_as_bucket_view":  # Hexagram's default differs (documented)
            assert ours[name].default == param.default, name
    assert ours["gradient_as_bucket_view"].default is True
    assert "PyTorch's default is False" in " ".join(hx.DistributedDataParallel.__doc__.split())
    assert [n for n in ours if n not in theirs] == list(HEXAGRAM_ONLY)
    assert all(ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in HEXAGRAM_ONLY)
    assert set(theirs) - {"self", "module"} <= torch_args.ARGUMENTS


@pytest.mark.timeout(120)
def test_torch_ddp_script_with_only_its_import_changed_matches_torch_ddp(
        tmp_path: Path) -> None:
    script = tmp_path / "torch_ddp.py"
    script.write_text(SCRIPT)
    changed = tmp_path / "hexagram_ddp.py"
    assert SCRIPT.count("from torch.nn.parallel import DistributedDataParallel as DDP") == 1
    changed.write_text(SCRIPT.replace(
        "from torch.nn.parallel import DistributedDataParallel as DDP", HEXAGRAM_IMPORT))
    for path in (script, changed):
        run_local(_run_script, world_size=2, args=(str(path), str(tmp_path / path.stem)),
                  timeout=90)
    for rank in (0, 1):
        ref = torch.load(tmp_path / f"torch_ddp.{rank}")
        got = torch.load(tmp_path / f"hexagram_ddp.{rank}")
        assert ref.keys() == got.keys()
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], rtol=0, atol=1e-6, msg=key)
    start = torch.load(tmp_path / "torch_ddp.0")["0.weight"]
    torch.manual_seed(0)
    assert not torch.equal(start, nn.Linear(8, 16).weight)  # it trained


def _legacy_and_groups() -> dict[str, Any]:
    """A rank of a 2-rank job that made its group itself: the former positional form,
    ``process_group``, ``init_sync`` and ``broadcast_buffers=False`` at work."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        legacy = hx.DistributedDataParallel(net, [opt], "local_sgd")
    out: dict[str, Any] = {
        "warning": [str(w.message) for w in caught if w.category is FutureWarning],
        "algorithm": legacy.algorithm.name, "optimizers": legacy.optimizers == [opt]}
    legacy.close()
    try:
        hx.DistributedDataParallel(net, process_group=dist.new_group([0]))
    except ConfigError as exc:
        out["subgroup"] = str(exc)
    with torch.no_grad():  # the legacy wrap broadcast rank 0's: make them differ again
        net[0].weight.fill_(rank)
        net[1].running_mean.fill_(rank)
    whole = hx.DistributedDataParallel(net, process_group=dist.new_group([0, 1]),
                                       init_sync=False, broadcast_buffers=False)
    out["weight"] = float(whole.module[0].weight[0, 0])
    out["running_mean"] = float(whole.module[1].running_mean[0])
    whole.close()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_former_positional_form_warns_and_group_arguments_keep_their_meaning() -> None:
    r0, r1 = run_local(_legacy_and_groups, world_size=2, timeout=90)
    for r in (r0, r1):
        assert r["algorithm"] == "local_sgd" and r["optimizers"]
        assert len(r["warning"]) == 1 and "optimizers=[...]" in r["warning"][0] \
            and "algorithm='local_sgd'" in r["warning"][0]
        assert "process_group" in r["subgroup"] and "subgroup" in r["subgroup"]
    assert (r0["weight"], r1["weight"]) == (0.0, 1.0)  # init_sync=False: no broadcast
    assert (r0["running_mean"], r1["running_mean"]) == (0.0, 1.0)  # buffers left alone


def _resolve(**kwargs: Any) -> torch_args.WrapOptions:
    return torch_args.resolve(nn.Linear(2, 2), 2, **kwargs)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"dim": 1}, "dim=1"),
    ({"mixed_precision": object()}, "mixed_precision"),
    ({"delay_all_reduce_named_params": [("w", None)]}, "delay_all_reduce_named_params"),
    ({"param_to_hook_all_reduce": nn.Parameter(torch.zeros(1))}, "param_to_hook_all_reduce"),
    ({"skip_all_reduce_unused_params": True}, "skip_all_reduce_unused_params"),
    ({"device_ids": [0]}, "device_ids"),
    ({"device_ids": [0, 1]}, "device_ids"),
    ({"output_device": 0}, "output_device"),
    ({"bucket_cap_mb": 3, "bucket_size_mb": 2}, "bucket_size_mb"),
    ({"bucket_cap_mb_list": [1, 2, 3]}, "bucket_cap_mb_list"),
    ({"bucket_cap_mb": -1}, "bucket_cap_mb"),
])
def test_arguments_that_cannot_apply_are_refused_by_name(kwargs: dict[str, Any],
                                                          named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        _resolve(**kwargs)


def test_arguments_with_their_meaning() -> None:
    default = _resolve()
    assert (default.bucket_mb, default.first_bucket_mb) == (torch_args.DEFAULT_BUCKET_MB, 1.0)
    assert default.forward_sync_buffers and default.init_sync_buffers
    assert _resolve(bucket_size_mb=4).bucket_mb == _resolve(bucket_cap_mb=4).bucket_mb == 4
    assert (_resolve(bucket_cap_mb_list=[0.5, 8]).first_bucket_mb,
            _resolve(bucket_cap_mb_list=[0.5, 8]).bucket_mb) == (0.5, 8)
    off = _resolve(broadcast_buffers=False)  # torch 2.13: also skips the wrap-time sync
    assert (off.forward_sync_buffers, off.init_sync_buffers) == (False, False)
    fwd = _resolve(broadcast_buffers=False, forward_sync_buffers=False)
    assert (fwd.forward_sync_buffers, fwd.init_sync_buffers) == (False, True)
    assert _resolve(static_graph=True).find_unused_parameters
    assert not _resolve(gradient_as_bucket_view=False).gradient_as_bucket_view
    with pytest.warns(FutureWarning, match="check_reduction"):
        _resolve(check_reduction=True)


def test_legacy_positionals_move_to_keywords_with_a_future_warning() -> None:
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.warns(FutureWarning, match="optimizers="):
        assert torch_args.legacy_positionals([opt], None, None, None) == (None, None, [opt],
                                                                          None)
    with pytest.warns(FutureWarning, match="algorithm='powersgd'"):
        assert torch_args.legacy_positionals(None, "powersgd", None, None) == (
            None, None, None, "powersgd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's own forms: no warning
        assert torch_args.legacy_positionals([0], "cuda:0", None, None) == ([0], "cuda:0",
                                                                             None, None)
        assert torch_args.legacy_positionals([], None, None, None) == ([], None, None, None)
    with pytest.raises(ConfigError, match="optimizers given twice"):
        torch_args.legacy_positionals([opt], None, [opt], None)


def _inputs_follow_device_ids() -> tuple[str, str]:
    """One NCCL rank: a CUDA module wrapped with ``device_ids=[0]`` gets CPU inputs moved
    to its device, as under PyTorch DDP."""
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    model = hx.DistributedDataParallel(nn.Linear(4, 2).cuda(), device_ids=[0],
                                       output_device=0)
    out = model(torch.randn(3, 4))  # on the CPU
    out.sum().backward()
    grad = model.module.weight.grad
    dist.destroy_process_group()
    return str(out.device), str(grad.device if grad is not None else None)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (device_ids=[0])")
def test_device_ids_move_inputs_to_the_module_device() -> None:
    assert run_local(_inputs_follow_device_ids, world_size=1, timeout=90) == [
        ("cuda:0", "cuda:0")]


def test_to_device_moves_every_tensor_of_nested_inputs() -> None:
    x, y = torch.zeros(1), torch.ones(1, dtype=torch.float64)
    moved = torch_args.to_device(((x, [y]), {"k": y, "n": 3}), torch.device("cpu"))
    assert torch.equal(moved[0][0], x) and moved[1]["n"] == 3
    assert torch_args.module_device(nn.Linear(1, 1).double()) == torch.device("cpu")
    assert torch_args.module_device(nn.ReLU()) is None
