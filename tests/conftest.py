"""Shared fixtures: real daemons on loopback, clients, and child-process helpers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

import dockd

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cluster():
    """A controller + 2 warehouses shared by tests that use their own partitions."""
    with dockd.start_local(num_warehouses=2, capacity="2GiB") as c:
        yield c


@pytest.fixture
def dock(cluster):
    with dockd.connect(cluster.address) as d:
        yield d


@pytest.fixture
def partition() -> str:
    return f"p-{uuid.uuid4().hex[:12]}"


def run_client(code: str, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """Run Python code in a fresh process (a separate client); sys.argv[1:] = args."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"client process failed ({proc.returncode}):\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.fixture
def client():
    return run_client
