"""The sample store: `core` is the pure logic, `daemon` the node process around it."""

from dockd.warehouse.core import Warehouse

__all__ = ["Warehouse"]
