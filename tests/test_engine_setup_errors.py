"""A weight algorithm wrapped without optimizers fails at wrap time with the fix; one
wrapped with ``optimizers="later"`` but used without ``attach_optimizers`` fails at the
first forward with the fix in its message, and closing or dropping it afterwards is
silent."""

from __future__ import annotations

import contextlib
import gc
import io

from hexagram.launch import run_local


def _without_optimizers(name: str) -> dict[str, str]:
    import torch

    import hexagram as hx

    hx.init()
    out = {"error": "", "stderr": "", "wrap_error": ""}
    try:
        hx.DistributedDataParallel(torch.nn.Linear(4, 2), algorithm=name)
    except hx.ConfigError as exc:
        out["wrap_error"] = str(exc)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        model = hx.DistributedDataParallel(torch.nn.Linear(4, 2), algorithm=name,
                                           optimizers="later")
        try:
            model(torch.randn(3, 4)).sum().backward()
        except hx.ConfigError as exc:
            out["error"] = str(exc)
        model.close()
        other = hx.DistributedDataParallel(torch.nn.Linear(4, 2), algorithm=name,
                                           optimizers="later")
        del other  # the drop-in case: never closed, released by the garbage collector
        gc.collect()
    out["stderr"] = err.getvalue()
    return out


def test_close_after_a_set_up_that_never_happened_is_silent() -> None:
    for name in ("diloco", "sparseloco", "local_sgd"):
        out = run_local(_without_optimizers, 1, args=(name,), timeout=120)[0]
        assert "attach_optimizers" in out["error"] and name in out["error"], out
        wrap_error = out["wrap_error"]
        assert name in wrap_error and "optimizers=[opt]" in wrap_error, out
        assert "optimizers='later'" in wrap_error and "\n" not in wrap_error, out
        assert out["stderr"] == "", f"{name}: {out['stderr']}"
