"""The metadata controller: `core` is the pure logic, `service` puts it on the wire."""

from dockd.controller.core import AcquireResult, Controller

__all__ = ["AcquireResult", "Controller"]
