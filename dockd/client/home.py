"""Which warehouse a client's puts go to (its home), chosen from the dock's warehouse table."""

from __future__ import annotations

import os
from collections.abc import Mapping

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError, DockValueError
from dockd.net.transport import is_local


def choose_home(warehouses: Mapping[int, pb.WarehouseInfo], *, pinned: int | str | None, prefer: str | None,
                exclude: int | None, retrying: bool, address: str) -> int:
    """The home warehouse's id: the one `pinned` names (its id or "host:port"), live or unresponsive,
    else a live one other than `exclude`: the one at `prefer` ("host:port"), else one on this host,
    spread over several by process id, else any. DockConnectionError when there is none to choose
    (the caller may wait for one: a pinned one is waited for only when `retrying`, else DockValueError).
    `address`: the dock's, for the errors."""
    live = [w for w in warehouses.values() if w.alive and w.id != exclude]
    if pinned is not None:
        for w in warehouses.values():
            # (an unresponsive one is still a member: a pinned client waits for it like for one that is away)
            if str(pinned) in (str(w.id), f"{w.host}:{w.port}") and (w.alive or w.state == "unresponsive"):
                return w.id
        if retrying:  # pinned, and away for now: wait for it to come back
            raise DockConnectionError(f"warehouse {pinned!r}, which this client is pinned to, is not live")
        raise DockValueError(
            f"warehouse {pinned!r} is not a live member of the dock at {address}; "
            f"members: {[f'{w.id}={w.host}:{w.port}' for w in live]}"
        )
    if not live:
        raise DockConnectionError(f"the dock at {address} has no live warehouse")
    for w in live:
        if f"{w.host}:{w.port}" == prefer:
            return w.id
    local = [w for w in live if is_local(w.host)] or live
    return local[os.getpid() % len(local)].id
