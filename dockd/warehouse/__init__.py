"""The sample store: `core` is the pure logic, `daemon` the node process around it (composed of
`listen`, `admission`, `put` with `commit` and `device_put`, `fetch`, `checkpoint` and `dispatch`)."""

from dockd.warehouse.core import Warehouse

__all__ = ["Warehouse"]
