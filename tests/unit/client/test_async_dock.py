"""AsyncDock: its methods are Dock's (signature and documentation written once), awaitable."""

from __future__ import annotations

import inspect

import dockd

# (Dock's own and those it inherits: its partition calls are PartitionCalls')
PUBLIC = [n for n in dir(dockd.Dock) if not n.startswith("_") and inspect.isfunction(getattr(dockd.Dock, n))]


def test_async_dock_has_every_public_dock_method_awaitable_with_its_signature_and_docs():
    assert len(PUBLIC) >= 20
    for name in [*PUBLIC]:
        if name == "close":
            continue
        sync, coro = getattr(dockd.Dock, name), getattr(dockd.AsyncDock, name)
        assert inspect.iscoroutinefunction(coro), name
        assert coro.__doc__ == sync.__doc__ and coro.__doc__, name
        want = [p for p in inspect.signature(sync).parameters.values() if not p.name.startswith("_")]
        assert list(inspect.signature(coro).parameters.values()) == want, name
        assert coro.__qualname__ == f"AsyncDock.{name}"
    assert inspect.iscoroutinefunction(dockd.AsyncDock.close)
