"""``hexagram.init()`` twice: the same request reuses the runtime, another one is refused."""

from __future__ import annotations

from hexagram.launch import run_local


def _twice() -> list[str]:
    import hexagram as hx

    first = hx.init()
    assert hx.init() is first and hx.init(backend="gloo") is first  # what is running
    errors = []
    for kwargs in ({"backend": "nccl"}, {"device": "cuda"}):
        try:
            hx.init(**kwargs)
        except hx.ConfigError as exc:
            errors.append(str(exc))
    return errors


def test_init_with_another_backend_or_device_than_the_live_one_raises() -> None:
    errors = run_local(_twice, 1, timeout=60)[0]
    assert len(errors) == 2, errors
    assert "already runs 'gloo'" in errors[0] and "shutdown()" in errors[0]
    assert "already communicates on cpu" in errors[1]
