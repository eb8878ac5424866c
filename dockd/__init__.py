"""dockd: a distributed transfer dock for reinforcement-learning post-training.

    import dockd
    with dockd.start_local(num_warehouses=2) as cluster:
        dock = dockd.connect(cluster.address)
        idx = dock.put({"prompts": prompts}, partition="step-0", group_size=8)
        batch = dock.get("reference", ["prompts"], count=16, partition="step-0", timeout=5.0)

`import dockd` is cheap: the exceptions and the version are plain imports; the
client (`connect`, `Dock`, `Batch`, ..., which need torch) and `start_local`
are imported on first use (PEP 562), so the `dockd` command's `--version`
costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dockd._version import __version__ as __version__
from dockd.errors import (
    DockAuthError,
    DockClosed,
    DockConfigError,
    DockConnectionError,
    DockDataLost,
    DockDrained,
    DockError,
    DockFull,
    DockLeaseError,
    DockNotFound,
    DockProtocolError,
    DockStateFull,
    DockTimeout,
    DockTypeError,
    DockValueError,
)

if TYPE_CHECKING:  # what the lazy names are, for type checkers and the API reference
    from dockd.client import AsyncDock, Batch, Dock, Jagged, Lease, connect, connect_async
    from dockd.local import LocalCluster, start_local

#: public name -> the module that defines it, imported on first access
_LAZY = {
    "AsyncDock": "dockd.client",
    "Batch": "dockd.client",
    "Dock": "dockd.client",
    "Jagged": "dockd.client",
    "Lease": "dockd.client",
    "connect": "dockd.client",
    "connect_async": "dockd.client",
    "LocalCluster": "dockd.local",
    "start_local": "dockd.local",
}

__all__ = [
    "AsyncDock",
    "Batch",
    "Dock",
    "DockAuthError",
    "DockClosed",
    "DockConfigError",
    "DockConnectionError",
    "DockDataLost",
    "DockDrained",
    "DockError",
    "DockFull",
    "DockLeaseError",
    "DockNotFound",
    "DockProtocolError",
    "DockStateFull",
    "DockTimeout",
    "DockTypeError",
    "DockValueError",
    "Jagged",
    "Lease",
    "LocalCluster",
    "connect",
    "connect_async",
    "start_local",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dockd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
