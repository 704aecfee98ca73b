"""The engine's non-finite check (:mod:`hexagram.engine.guard`): right flags, clean buckets,
no host read, and a number of aten ops that does not grow with the number of tensors.

One rank (gloo on the CPU; NCCL under the ``gpu`` marker) runs the guard's whole step on
real buckets and a real communicator: observe, agree (collective), poison, poison_grads,
check_step, and :func:`~hexagram.engine.guard.agree_finite_grads`.

What is countable on the CPU: the aten ops the guard dispatches (a
``TorchDispatchMode`` sees each top-level op once; on CUDA each is one kernel launch or a
few, ``_foreach_norm`` one per ~hundred tensors) and the Python-level host reads
(``Tensor.item``, ``bool``, ``tolist``, ...; plus ``aten._local_scalar_dense``, the op
behind every scalar read). Views made per tensor (``poison_grads``: the ``.grad`` tensors
change from step to step, so their views cannot be cached) launch no kernel and are not
counted there. Under the ``gpu`` marker the same step runs with
``torch.cuda.set_sync_debug_mode("error")``: any sync raises.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hexagram.launch import run_local

DTYPES = ("float32", "bfloat16", "float16")
#: per tensor of the test bucket: what is written into its second element
PLANTED = ("clean", "nan", "+inf", "-inf", "large", "clean")
_READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy",
          "nonzero")
_READ_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique")


def _bucket(dtype: torch.dtype, sizes: list[int], device: torch.device) -> Any:
    from hexagram.buckets import build_buckets

    params = [(f"t{i}", torch.nn.Parameter(torch.empty(n, dtype=dtype, device=device)))
              for i, n in enumerate(sizes)]
    (bucket,) = build_buckets(params, bucket_bytes=1 << 30)
    gen = torch.Generator(device=device).manual_seed(0)
    bucket.flat.copy_(torch.randn(bucket.numel, generator=gen, device=device))
    return bucket


def _plant(bucket: Any) -> None:
    """Write each tensor's planted value (``PLANTED``) into its second element; "large"
    is finite but its square overflows float16 (fp16: 6e4, others: 1e18) in 3 elements."""
    large = 6.0e4 if bucket.dtype == torch.float16 else 1.0e18
    values = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
    for entry, what in zip(bucket.entries, PLANTED):
        view = bucket.flat[entry.offset:entry.offset + entry.numel]
        if what == "large":
            view[:3] = large
        elif what != "clean":
            view[1] = values[what]


#: set in a CUDA worker: inside :class:`_Reads`, any synchronising CUDA call raises
_SYNC_DEBUG = [False]


class _Reads:
    """Records every host read made while installed (methods of ``torch.Tensor``); on
    CUDA (``_SYNC_DEBUG``) any sync raises as well."""

    def __init__(self) -> None:
        self.sites: list[str] = []
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> _Reads:
        if _SYNC_DEBUG[0]:
            torch.cuda.set_sync_debug_mode("error")
        for name in _READS:
            original = self.saved[name] = getattr(torch.Tensor, name)

            def counted(*args: Any, _name: str = name, _orig: Any = original,
                        **kwargs: Any) -> Any:
                self.sites.append(_name)
                return _orig(*args, **kwargs)
            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *_: Any) -> None:
        if _SYNC_DEBUG[0]:
            torch.cuda.set_sync_debug_mode("default")
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


def _ops_of(fn: Any, kernels_only: bool = False) -> list[str]:
    """The aten ops ``fn()`` dispatches (view ops left out with ``kernels_only``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if not (kernels_only and func.is_view):
                self.ops.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    with Ops() as mode:
        fn()
    return mode.ops


def _one_step(comm: Any, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """The guard's whole step on a planted bucket; what it flagged, cleaned and poisoned."""
    from hexagram.engine.guard import FiniteGuard
    from hexagram.errors import NonFiniteGradientError

    bucket = _bucket(dtype, [5, 7, 3, 4, 6, 2], device)
    _plant(bucket)
    planted = bucket.flat.clone()
    guard = FiniteGuard([bucket], comm)
    guard.collective = True
    with _Reads() as reads:
        ops = _ops_of(lambda: guard.observe(bucket))
        guard.agree()
        result = bucket.flat.clone()
        guard.poison(bucket, result)
        grads = [e.param for e in bucket.entries]
        for p, e in zip(grads, bucket.entries):
            p.grad = bucket.flat[e.offset:e.offset + e.numel].clone()
        guard.poison_grads(bucket, frozenset({"t5"}))
    try:
        guard.check_step(step=4, policy="raise")
        message = ""
    except NonFiniteGradientError as exc:
        message = str(exc)
    return {"flagged": guard.flagged(), "planted": planted.float().cpu(),
            "cleaned": bucket.flat.float().cpu(), "poisoned": result.float().cpu(),
            "grads": [p.grad.float().cpu() for p in grads], "reads": reads.sites,
            "ops": [o for o in ops if o in _READ_OPS], "message": message,
            "offsets": [e.offset for e in bucket.entries]}


def _count(comm: Any, bucket: Any) -> dict[str, Any]:
    """Ops of observe / poison / poison_grads / agree_finite_grads on ``bucket``."""
    from hexagram.engine.guard import FiniteGuard, agree_finite_grads

    guard = FiniteGuard([bucket], comm)
    params = [e.param for e in bucket.entries]
    for p in params:
        p.grad = torch.ones_like(p)
    with _Reads() as reads:
        observe = _ops_of(lambda: guard.observe(bucket))
        guard.agree()
        poison = _ops_of(lambda: guard.poison(bucket, bucket.flat))
        grads = _ops_of(lambda: guard.poison_grads(bucket, frozenset()), True)
        agree = _ops_of(lambda: agree_finite_grads(comm, params), True)
    return {"observe": observe, "poison": poison, "poison_grads": grads,
            "agree_finite_grads": agree, "reads": reads.sites}


def _counts(comm: Any, device: torch.device) -> dict[str, Any]:
    """:func:`_count` at 8 and 128 tensors of 1000 elements, float32 and bfloat16."""
    return {f"{n}/{dtype}": _count(comm, _bucket(dtype, [1000] * n, device))
            for n in (8, 128) for dtype in (torch.float32, torch.bfloat16)}


def _worker(sync_debug: bool) -> dict[str, Any]:
    import hexagram as hx
    from hexagram.comm.communicator import Communicator

    rt = hx.init()
    comm = Communicator(None, rt.timeout, "guard")
    _SYNC_DEBUG[0] = sync_debug
    steps = {name: _one_step(comm, getattr(torch, name), rt.device) for name in DTYPES}
    counts = _counts(comm, rt.device)
    comm.close()
    hx.shutdown()
    return {"steps": steps, "counts": counts}


@pytest.fixture(scope="module")
def cpu_run() -> dict[str, Any]:
    (out,) = run_local(_worker, 1, args=(False,), timeout=240)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_flags_exactly_the_nonfinite_tensors(cpu_run: dict[str, Any], dtype: str) -> None:
    step = cpu_run["steps"][dtype]
    expected = [f"t{i}" for i, what in enumerate(PLANTED) if what in ("nan", "+inf", "-inf")]
    assert step["flagged"] == expected  # "large" (finite, fp16 square overflows) is not
    assert "non-finite gradient (NaN or Inf) at step 4: parameter 't1'" in step["message"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_bucket_is_cleaned_and_otherwise_unchanged(cpu_run: dict[str, Any], dtype: str) -> None:
    step = cpu_run["steps"][dtype]
    expected = step["planted"].nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    assert torch.equal(step["cleaned"], expected)
    assert torch.isfinite(step["cleaned"]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_poison_puts_inf_first_in_every_tensor(cpu_run: dict[str, Any], dtype: str) -> None:
    step = cpu_run["steps"][dtype]
    cleaned, poisoned, offsets = step["cleaned"], step["poisoned"], step["offsets"]
    want = cleaned.clone()
    want[offsets] = float("inf")
    assert torch.equal(poisoned, want)
    for i, grad in enumerate(step["grads"]):  # t5 was skipped: its .grad stays as it was
        own = cleaned[offsets[i]:offsets[i] + grad.numel()]
        assert grad[0].item() == (own[0].item() if i == 5 else float("inf"))
        assert torch.equal(grad[1:], own[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_host_read_in_observe_agree_poison(cpu_run: dict[str, Any], dtype: str) -> None:
    step = cpu_run["steps"][dtype]
    assert step["reads"] == [] and step["ops"] == []
    for key, counted in cpu_run["counts"].items():
        assert counted["reads"] == [], f"{key}: host reads {counted['reads']}"


@pytest.mark.parametrize("part", ["observe", "poison", "poison_grads", "agree_finite_grads"])
def test_aten_ops_do_not_grow_with_tensors(cpu_run: dict[str, Any], part: str) -> None:
    counts = cpu_run["counts"]
    for dtype in ("torch.float32", "torch.bfloat16"):
        few, many = counts[f"8/{dtype}"][part], counts[f"128/{dtype}"][part]
        assert few == many, f"{part} ({dtype}): {len(few)} ops at 8 tensors, {len(many)} " \
            f"at 128: {many}"
        assert not set(many) & set(_READ_OPS)
    assert len(counts["128/torch.float32"]["observe"]) <= 5, counts["128/torch.float32"]


@pytest.mark.gpu
def test_no_sync_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (torch.cuda.is_available() is False)")
    (out,) = run_local(_worker, 1, args=(True,), timeout=240)
    for dtype in DTYPES:
        step = out["steps"][dtype]
        assert step["flagged"] == [f"t{i}" for i, w in enumerate(PLANTED)
                                   if w in ("nan", "+inf", "-inf")]
        assert torch.isfinite(step["cleaned"]).all()
