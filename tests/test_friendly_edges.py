"""A new user's edges: ``--version``, ``python -m hexagram``, the LICENSE file, and one line
naming the ``pip install "hexagram[EXTRA]"`` wherever an optional dependency is missing.

A missing module is emulated the way Python itself supports: ``sys.modules[name] = None``
makes ``import name`` raise ``ModuleNotFoundError``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import hexagram
from hexagram.cli import main
from hexagram.errors import MissingExtraError, require

ROOT = Path(__file__).resolve().parent.parent


def _project(key: str) -> str:
    """A top-level ``[project]`` value of pyproject.toml (tomllib is Python 3.11+)."""
    match = re.search(rf"^{key} = (.+)$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert match, key
    return match.group(1)


def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_version_matches_pyproject(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    version = _project("version").strip('"')
    assert capsys.readouterr().out.strip() == f"hexagram {version}"
    assert hexagram.__version__ == version


def test_python_dash_m_runs_the_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "hexagram", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert "simulate" in proc.stdout and "--version" in proc.stdout


def test_unknown_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sumulate"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'sumulate'" in capsys.readouterr().err


def test_license_is_apache_2() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n")
    assert "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    for section in range(1, 10):  # the nine numbered sections of the terms
        assert f"\n   {section}. " in text, section
    assert _project("license") == '{ text = "Apache-2.0" }'


def test_plan_without_solvers_says_which_extra(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _hide(monkeypatch, "highspy", "pulp")
    code = main(["plan", "--model", "mlp", "--layers", "2", "--width", "64",
                 "--cluster", "1x2"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and 'pip install "hexagram[planner]"' in err, err


def test_bench_without_rich_or_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    from hexagram.bench import cli as bench_cli
    from hexagram.bench import report

    _hide(monkeypatch, "rich", "rich.progress", "matplotlib")
    with pytest.raises(MissingExtraError, match=r'pip install "hexagram\[bench\]"'):
        bench_cli._progress(3, quiet=True)
    with pytest.raises(MissingExtraError, match=r'pip install "hexagram\[bench\]"'):
        report.plot_throughput({"unshaped": []}, "unused.png")


def test_digits_without_scikit_learn(monkeypatch: pytest.MonkeyPatch) -> None:
    from hexagram.data import vision

    _hide(monkeypatch, "sklearn", "sklearn.datasets")
    with pytest.raises(MissingExtraError, match=r'pip install "hexagram\[data\]"') as info:
        vision._digits()
    assert info.value.name == "sklearn" and isinstance(info.value, ImportError)


@pytest.mark.parametrize("framework", ["lightning", "accelerate", "transformers"])
def test_integrations_without_their_framework(monkeypatch: pytest.MonkeyPatch,
                                              framework: str) -> None:
    _hide(monkeypatch, framework)
    monkeypatch.delitem(sys.modules, f"hexagram.integrations.{framework}", raising=False)
    with pytest.raises(MissingExtraError) as info:
        __import__(f"hexagram.integrations.{framework}")
    assert str(info.value) == (f"hexagram.integrations.{framework} needs {framework}, which "
                               'is not installed: pip install "hexagram[integrations]"')


def test_require_shows_a_broken_dependency_as_it_is(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed module whose own import fails is not reported as a missing extra."""
    (tmp_path / "halfbroken.py").write_text("import nosuchdependency_abc\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        require("halfbroken", extra="data", feature="a test")
    assert not isinstance(info.value, MissingExtraError)
    assert info.value.name == "nosuchdependency_abc"
