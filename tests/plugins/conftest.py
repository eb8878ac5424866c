"""Shared fixtures of the trainer-plugin tests: real dockd daemons, a small Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

import dockd


@pytest.fixture(scope="module")
def dock_cluster() -> Iterator[dockd.LocalCluster]:
    """Two real warehouses and a controller on loopback."""
    with dockd.start_local(num_warehouses=2) as cluster:
        yield cluster


@pytest.fixture()
def dock(dock_cluster: dockd.LocalCluster) -> Iterator[dockd.Dock]:
    with dockd.connect(dock_cluster.address) as d:
        yield d


def _run_python(code: str, *, env: dict[str, str] | None = None, timeout: float = 120.0) -> str:
    """Run `code` in a fresh interpreter (another process); return its stdout, fail on errors."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


@pytest.fixture(scope="session")
def run_python() -> Any:
    """`run_python(code, env=None, timeout=120)`: run code in a fresh interpreter, return its stdout."""
    return _run_python
