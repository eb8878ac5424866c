"""`make dist`'s wheel installs into a fresh virtualenv next to torch and runs `dockd demo`.

The fresh venv is a plain `python -m venv` (no system site-packages): torch
goes in first, pinned like the Makefile pins it (a local CPU wheel on the
development machines), then the wheel, which brings the rest from the
package index. Skipped where that torch cannot be installed.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TORCH = os.environ.get("DOCKD_TEST_TORCH", "torch==2.13.0")  # what the Makefile installs


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _no_index(proc: subprocess.CompletedProcess) -> bool:
    """pip could not reach a package index (an offline machine): nothing to test here."""
    text = proc.stdout + proc.stderr
    return proc.returncode != 0 and ("No matching distribution found" in text or "Could not find a version" in text)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_installs_in_a_fresh_venv_and_runs_the_demo(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("build", reason="python -m build is in the dev extra: pip install -e '.[dev]'")
    dist = tmp_path / "dist"
    out = _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(ROOT)], 300)
    if _no_index(out):
        pytest.skip("no package index for the isolated build (setuptools)")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (wheel,) = dist.glob("dockd-*-py3-none-any.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("dockd/__init__.py", "dockd/cli.py", "dockd/_proto/__init__.py", "dockd/_proto/dockd_pb2.py",
                   "dockd/_proto/dockd_pb2_grpc.py", "dockd/node/daemon.py", "dockd/controller/core.py"):
        assert needed in names, needed
    assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names), sorted(names)[:20]

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], 120).check_returncode()
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    got = _run([*pip, TORCH], 300)
    if got.returncode != 0:
        pytest.skip(f"cannot install {TORCH} here: {got.stderr.strip()[-300:]}")
    got = _run([*pip, str(wheel)], 300)
    if _no_index(got):
        pytest.skip(f"no package index for the wheel's dependencies: {got.stderr.strip()[-300:]}")
    assert got.returncode == 0, got.stderr[-3000:]

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    dockd_bin = str(venv / "bin" / "dockd")
    ver = _run([dockd_bin, "--version"], 60, cwd=tmp_path, env=env)
    assert ver.returncode == 0 and ver.stdout.startswith("dockd "), ver
    where = _run([str(venv / "bin" / "python"), "-c", "import dockd; print(dockd.__file__)"], 60, cwd=tmp_path,
                 env=env)
    assert where.stdout.strip().startswith(str(venv)), where  # the installed wheel, not the checkout
    demo = _run([dockd_bin, "--log-level", "WARNING", "demo", "--steps", "2", "--prompts", "4"], 240, cwd=tmp_path,
                env=env)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "2 steps x 32 samples through 2 warehouses" in demo.stdout, demo.stdout
