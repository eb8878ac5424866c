"""The public surface and the generated wire modules."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import dockd

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_public_api_is_stable():
    assert sorted(dockd.__all__) == sorted([
        "AsyncDock", "Batch", "Dock", "DockAuthError", "DockClosed", "DockConfigError", "DockConnectionError", "DockDataLost", "DockDrained", "DockError",
        "DockFull", "DockLeaseError", "DockNotFound", "DockProtocolError", "DockStateFull", "DockTimeout", "DockTypeError", "DockValueError", "Jagged", "Lease",
        "LocalCluster", "connect", "connect_async", "start_local",
    ])
    for name in dockd.__all__:
        assert getattr(dockd, name) is not None


def test_exception_tree():
    for exc in (dockd.DockTimeout, dockd.DockFull, dockd.DockDataLost, dockd.DockConnectionError,
                dockd.DockProtocolError, dockd.DockValueError, dockd.DockTypeError, dockd.DockNotFound, dockd.DockClosed,
                dockd.DockAuthError, dockd.DockLeaseError, dockd.DockDrained, dockd.DockStateFull, dockd.DockConfigError):
        assert issubclass(exc, dockd.DockError)
    assert issubclass(dockd.DockValueError, ValueError) and issubclass(dockd.DockTypeError, TypeError)
    assert issubclass(dockd.DockTimeout, TimeoutError)


def test_generated_proto_modules_are_fresh(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "proto" / "gen.py"), str(tmp_path)], check=True, capture_output=True)
    for fresh in tmp_path.glob("*.py"):
        committed = ROOT / "dockd" / "_proto" / fresh.name
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run `make proto` and commit"


def test_core_does_not_import_plugins_or_sockets():
    """Dependencies point one way; controller and warehouse cores stay pure."""
    for path in (ROOT / "dockd").rglob("*.py"):
        if "trainer_plugins" in path.parts:
            continue
        assert "trainer_plugins" not in path.read_text(), f"{path} imports a plugin"
    for core in ("controller/core.py", "warehouse/core.py"):
        text = (ROOT / "dockd" / core).read_text()
        for banned in ("import socket", "import asyncio", "import grpc"):
            assert banned not in text, f"{core} must stay free of I/O ({banned})"


def test_the_drawn_tree_holds_the_device_errors_and_resharding_has_its_own():
    from dockd._proto import dockd_pb2 as pb
    from dockd.device import DockDeviceError
    from dockd.errors import StagingUnknown, from_status, to_status
    from dockd.resharding import ReshardError

    assert issubclass(DockDeviceError, dockd.DockError)
    assert issubclass(ReshardError, RuntimeError) and not issubclass(ReshardError, dockd.DockError)
    status = pb.Status()
    to_status(StagingUnknown("unknown staging buffer 3"), status)  # told apart by its code, not its text
    assert status.code == pb.STAGING_UNKNOWN and isinstance(from_status(status), StagingUnknown)
    assert isinstance(from_status(status), dockd.DockNotFound)


def test_import_dockd_is_lazy_and_every_public_name_resolves():
    """`import dockd` imports neither the client nor torch; each public name loads on first use (PEP 562)."""
    code = """
import sys, dockd
assert "torch" not in sys.modules and "dockd.client" not in sys.modules and "dockd.local" not in sys.modules
assert set(dockd.__all__) <= set(dir(dockd))
try:
    dockd.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("dockd.no_such_name resolved")
from dockd import connect, start_local
from dockd.client import connect as client_connect
from dockd.local import start_local as local_start
assert connect is client_connect and start_local is local_start and dockd.Dock.__module__ == "dockd.client.dock"
assert all(getattr(dockd, n) is not None for n in dockd.__all__)
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
