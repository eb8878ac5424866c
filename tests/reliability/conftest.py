"""Fixtures of the reliability tests."""

from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture
def small_fs(request, tmp_path):
    """A small tmpfs (root only; its size the test module's SMALL_FS, 1 MiB if it says none), unmounted at the
    end: a state dir or data dir that fills up."""
    size = getattr(request.module, "SMALL_FS", "1m")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
