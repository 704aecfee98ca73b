"""Device discipline off the training thread, shown without a GPU.

The current CUDA device is per thread (0 in every thread the library starts), so a tensor
for a collective must take its device from the runtime, never from the thread. Three checks
the CPU can make: (1) the helper gives the runtime's device in every thread, seen with a
runtime on the ``meta`` device (a CPU-only fake device: a tensor made from the thread's state
would land on the CPU instead); (2) every thread the library starts sets its device first
(the async averager's round thread and each communicator's issuing thread); (3) the robust
aggregators build their weights and mixing matrices on the rows' device.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch

from hexagram.launch import run_local
from hexagram.robust import aggregators as agg


def _helper_in_threads() -> dict[str, Any]:
    import hexagram as hx
    from hexagram import runtime
    from hexagram.comm import device

    rt = hx.init(backend="gloo")
    runtime._RUNTIME = dataclasses.replace(rt, device=torch.device("meta"))
    seen: dict[str, Any] = {"main": str(device.control_tensor([1, 2]).device)}

    def record() -> None:
        seen["library thread"] = str(device.group_device(None))
        seen["control"] = str(device.control_zeros(1).device)
        seen["measured"] = str(device.group_tensor([0.5]).device)

    device.start_thread(record, name="hexagram-test").join()
    plain = threading.Thread(target=lambda: seen.setdefault(
        "plain thread", str(device.group_device(None))))
    plain.start()
    plain.join()
    try:  # the wrapper refuses a model left on another device, naming both
        hx.DistributedDataParallel(torch.nn.Linear(2, 2))
    except hx.ConfigError as exc:
        seen["wrong device"] = str(exc)
    runtime._RUNTIME = rt
    return seen


def test_collective_tensors_take_the_runtimes_device_in_every_thread() -> None:
    seen = run_local(_helper_in_threads, 1, timeout=60)[0]
    error = seen.pop("wrong device")
    assert "'weight' is on cpu" in error and "communicates on meta" in error, error
    assert set(seen.values()) == {"meta"}, seen


def _threads_set_their_device() -> list[tuple[str, str]]:
    import hexagram as hx
    from hexagram.comm import device

    calls: list[tuple[str, str]] = []
    real = device.set_thread_device

    def spy(dev: torch.device | None) -> None:
        calls.append((threading.current_thread().name.split("_")[0], str(dev)))
        real(dev)

    device.set_thread_device = spy  # type: ignore[assignment]
    rt = hx.init()
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ddp = hx.DistributedDataParallel(net, [opt], algorithm="async")
    for _ in range(2):
        ddp(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    ddp.synchronize()
    ddp.close()
    return sorted(set(c for c in calls if c[1] == str(rt.device)))


def test_every_library_thread_sets_its_device_before_any_work() -> None:
    for calls in run_local(_threads_set_their_device, 2, timeout=90):
        names = {name for name, _ in calls}
        assert "hexagram-async-average" in names, calls
        assert "hexagram-comm-async" in names, calls  # the averager's issuing thread


@pytest.mark.parametrize("name", ["geomed", "centered_clip", "nnm", "bucketing"])
def test_robust_aggregators_stay_on_the_rows_device(name: str) -> None:
    x = torch.randn(5, 7, dtype=torch.float64, device="meta")
    gen = torch.Generator().manual_seed(0)  # CPU draws, mixing matrix on the rows' device
    out = {"geomed": lambda: agg.geomed(x), "centered_clip": lambda: agg.centered_clip(x),
           "nnm": lambda: agg.nnm(x, 1), "bucketing": lambda: agg.bucketing(x, 2, gen)}[name]()
    assert out.device == x.device and out.shape[-1] == 7
