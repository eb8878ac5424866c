"""Clients: the blocking `Dock`, its awaitable twin `AsyncDock`, `Batch`, and `Jagged` (a ragged column
given as one values buffer plus offsets)."""

from dockd.client.async_dock import AsyncDock, connect_async
from dockd.client.batch import Batch
from dockd.client.dock import Dock
from dockd.client.lease import Lease
from dockd.codec import Jagged


def connect(address: str, **kwargs) -> Dock:
    """Connect to the dock whose controller listens at `address` ("host:port")."""
    return Dock(address, **kwargs)


__all__ = ["AsyncDock", "Batch", "Dock", "Jagged", "Lease", "connect", "connect_async"]
