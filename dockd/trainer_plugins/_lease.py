"""Hand a lease's samples to other processes as metadata only.

A lease from `dockd.Dock.acquire` carries the warehouse location of every
(column, sample), except for the columns the controller's own warehouse holds:
those come inline, values included, and have no location row. To let other
processes fetch a lease themselves (a verl worker, a peer tensor-parallel
rank), `metadata_only` points those columns at the controller's warehouse
instead, so the payload never travels with the metadata.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def controller_warehouse(dock: Any) -> int | None:
    """Id of the warehouse hosted by the controller's daemon, or None if it has none."""
    # TODO(core): use a public accessor once Dock exposes one (e.g. acquire(inline=False))
    for wid, info in getattr(dock, "_warehouses", {}).items():
        if f"{info.host}:{info.port}" == dock.address:
            return int(wid)
    return None


def metadata_only(dock: Any, lease: Any) -> tuple[np.ndarray, dict[str, list[Any]]]:
    """(locations for every column, inline values still needed) of `lease`.

    The second item is empty unless the controller's warehouse could not be identified,
    in which case the inline values must travel with the metadata.
    """
    inline: dict[str, list[Any]] = dict(getattr(lease, "inline", {}) or {})
    n = len(lease.indexes)
    if lease.locations is not None:
        locations = np.array(lease.locations, dtype=np.int64).reshape(len(lease.columns), n)
    else:
        locations = np.full((len(lease.columns), n), -1, dtype=np.int64)
    if not inline:
        return locations, {}
    wid = controller_warehouse(dock)
    if wid is None:
        logger.warning("[plugins] controller warehouse unknown; inline columns %s travel with the lease", list(inline))
        return locations, inline
    for ci, col in enumerate(lease.columns):
        if col in inline:
            locations[ci, :] = wid
    return locations, {}
