"""Hand a lease's samples to other processes as metadata only.

A lease acquired with `dockd.Dock.acquire(..., inline=False)` carries the
warehouse location of every (column, sample) and no values, so another process
(a verl worker, a peer tensor-parallel rank) can fetch its share itself and the
payload never travels with the metadata.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def metadata_only(dock: Any, lease: Any) -> tuple[np.ndarray, dict[str, list[Any]]]:
    """(locations for every column, inline values) of a lease acquired with inline=False.

    The second item is always empty; it is kept so callers can ship both unchanged.
    """
    if getattr(lease, "inline", None):
        raise ValueError("this lease carries inline values; acquire it with inline=False to hand it on as metadata")
    n = len(lease.indexes)
    return np.array(lease.locations, dtype=np.int64).reshape(len(lease.columns), n), {}
