"""What the catalog answers without changing anything: a listing of a partition's samples (their
tags, those not yet handed to a consumer), how many a consumer could take now, and what a get that
timed out is told about it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dockd.controller import selection
from dockd.controller.catalog import Catalog
from dockd.controller.partition import FREE


def list_samples(cat: Catalog, partition: str, *, consumer: str = "", where: selection.Where | None = None,
                 limit: int = 1000, start: int = 0) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Samples (not deleted, a column written; not yet handed to `consumer` if given) whose tags
    lie in `where`, smallest indexes from `start` first, at most `limit`; with their tags. Takes
    nothing."""
    part = cat.part(partition)
    n = part.size
    mask = part.live()
    cons = part.consumers.get(consumer) if consumer else None
    if cons is not None:
        mask &= cons.state[:n] == FREE
    mask[: min(start, n)] = False
    idx = np.flatnonzero(mask)
    if where:
        idx = idx[selection.within(part, idx, where)]
    idx = idx[:limit]
    tags = {name: arr[idx] for name, arr in part.tags.items()}
    return idx, tags


def ready_count(cat: Catalog, partition: str, consumer: str, columns: Sequence[str], groups: bool = False) -> int:
    """How many samples `consumer` could take right now (whole groups only with groups=True)."""
    part = cat.partitions.get(partition)
    if part is None:
        return 0
    mask = part.mask_of(columns)
    if mask is None:
        return 0
    sub = part.subscription(part.consumer(consumer), mask, groups)
    return sub.eligible.total * (part.group_size if groups else 1)


def all_taken(cat: Catalog, partition: str, consumer: str) -> int | None:
    """How many samples `consumer` took of a partition when it has had every one of them (none is
    free for it, being written or leased to it); None otherwise."""
    part = cat.partitions.get(partition)
    cons = part.consumers.get(consumer) if part is not None else None
    if part is None or cons is None or not cons.taken or cons.leased:
        return None
    n = part.size
    if (~part.gone[:n] & (cons.state[:n] == FREE)).any():
        return None
    return cons.taken


def why_not_ready(cat: Catalog, partition: str, columns: Sequence[str]) -> str:
    """A hint for timeout messages: unknown partition or columns."""
    part = cat.partitions.get(partition)
    if part is None:
        return f" Partition {partition!r} does not exist yet (nothing was put in it)."
    missing = [c for c in columns if c not in part.columns]
    if missing:
        return f" No sample of partition {partition!r} has column(s) {missing} yet; known: {sorted(part.columns)}."
    return ""
