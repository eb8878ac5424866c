"""Clients: the blocking `Dock`, its awaitable twin `AsyncDock`, and `Batch`."""

from dockd.client.async_dock import AsyncDock, connect_async
from dockd.client.batch import Batch
from dockd.client.dock import Dock
from dockd.client.lease import Lease


def connect(address: str, **kwargs) -> Dock:
    """Connect to the dock whose controller listens at `address` ("host:port")."""
    return Dock(address, **kwargs)


__all__ = ["AsyncDock", "Batch", "Dock", "Lease", "connect", "connect_async"]
