"""dockd: a distributed transfer dock for reinforcement-learning post-training.

    import dockd
    with dockd.start_local(num_warehouses=2) as cluster:
        dock = dockd.connect(cluster.address)
        idx = dock.put({"prompts": prompts}, partition="step-0", group_size=8)
        batch = dock.get("reference", ["prompts"], count=16, partition="step-0", timeout=5.0)
"""

from dockd.client import AsyncDock, Batch, Dock, Lease, connect, connect_async
from dockd.errors import (
    DockAuthError,
    DockClosed,
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
from dockd._version import __version__ as __version__
from dockd.local import LocalCluster, start_local

__all__ = [
    "AsyncDock",
    "Batch",
    "Dock",
    "DockAuthError",
    "DockClosed",
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
    "Lease",
    "LocalCluster",
    "connect",
    "connect_async",
    "start_local",
]
