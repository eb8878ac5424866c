"""The controller's state as plain dicts of bytes and numbers (no pickle), for the journal's
snapshots and records and for checkpoints. The format is the state dir's: changing it breaks
restarts from existing state dirs."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from dockd.controller.catalog import PUT_KEYS_CELLS, PUT_KEYS_KEPT, Catalog, indexes_of
from dockd.controller.lease_table import Lease
from dockd.controller.partition import FREE, LEASED, NO_WAREHOUSE, PENDING_WAREHOUSE, _Partition
from dockd.errors import DockValueError
from dockd.recent import Recent


def export_partition(p: _Partition) -> dict:
    n = p.size
    return {
        "name": p.name, "group_size": p.group_size, "size": n, "recovered": p.recovered,
        "ready": p.ready[:n].tobytes(), "columns": list(p.columns),
        "loc": [p.loc[c][:n].tobytes() for c in p.columns],
        # replicas (a copy still on its way counts as none: it is made again)
        "rloc": [[c, np.where(a[:n] == PENDING_WAREHOUSE, NO_WAREHOUSE, a[:n]).astype(np.uint16).tobytes()]
                 for c, a in p.rloc.items()],
        "nbytes": [[w, b] for w, b in p.nbytes.items()],
        "consumers": [[name, c.state[:n].tobytes(), c.taken] for name, c in p.consumers.items()],
        "gone": p.gone[:n].tobytes(), "deleted": p.deleted, "sealed": p.sealed, "retire": list(p.retire),
        "tags": [[name, arr[:n].tobytes()] for name, arr in p.tags.items()],
        "async": [p.version, p.max_staleness, p.retire_stale, p.max_pending, p.stale_retired],
    }


def import_partition(d: dict) -> _Partition:
    p = _Partition(d["name"], d["group_size"])
    p.recovered = d["recovered"]
    n = d["size"]
    p.reserve(n)
    p.size = n
    p.ready[:n] = np.frombuffer(d["ready"], dtype=np.uint64)
    for col, raw in zip(d["columns"], d["loc"]):
        p.bit(col)
        p.loc[col][:n] = np.frombuffer(raw, dtype=np.uint16)
    for col, raw in d.get("rloc", ()):
        p.rloc[col] = np.full(p.capacity, NO_WAREHOUSE, dtype=np.uint16)
        p.rloc[col][:n] = np.frombuffer(raw, dtype=np.uint16)
    p.nbytes = {w: b for w, b in d["nbytes"]}
    if "gone" in d:
        p.gone[:n] = np.frombuffer(d["gone"], dtype=bool)
        p.deleted, p.sealed, p.retire = d["deleted"], d["sealed"], tuple(d["retire"])
        for name, raw in d["tags"]:
            p.tag(name, create=True)[:n] = np.frombuffer(raw, dtype=np.int64)
    if "async" in d:
        p.version, p.max_staleness, p.retire_stale, p.max_pending, p.stale_retired = d["async"]
    for name, state, taken in d["consumers"]:
        cons = p.consumer(name)
        cons.state[:n] = np.frombuffer(state, dtype=np.uint8)
        cons.state[:n][cons.state[:n] == LEASED] = FREE  # leases are restored by the caller, or end here
        cons.taken = taken
    return p


def snapshot(cat: Catalog, leases: Iterable[Lease], lease_timeout: float, wall_offset: float) -> dict:
    """Everything needed to rebuild a controller: its catalog, its leases and their default timeout.
    Lease deadlines are stored on the wall clock (`deadline + wall_offset`) so another process can
    restore them."""
    return {
        "version": 2,
        "lease_timeout": lease_timeout,
        "dead": sorted(cat.dead_warehouses),
        "partitions": [export_partition(p) for p in cat.partitions.values()],
        # (a lease split from one grant names the others: see LeaseTable.split)
        "leases": [[l.id, l.partition, l.consumer, l.indexes.tobytes(), l.deadline + wall_offset, l.token, l.owner,
                    *([list(l.rest)] if l.rest else [])] for l in leases],
        "put_keys": [[w, [[k, _kept_out(v)] for k, v in keys.items()]] for w, keys in cat.put_keys.items()],
        # (writer tokens: a put re-sent to another warehouse after a restart is still applied once)
        "tokens": [[tok, part, list(cols), _kept_out(v)] for tok, (part, cols, v) in cat.tokens.items()],
    }


def restore(cat: Catalog, grant: Callable[..., Lease], snap: dict, *, wall_offset: float) -> None:
    """Fill a fresh controller's catalog from a snapshot, and its leases through `grant` (Controller.grant);
    lease deadlines are moved onto this process's clock."""
    cat.dead_warehouses.update(snap["dead"])
    for d in snap["partitions"]:
        cat.adopt(import_partition(d))
    for lid, part, consumer, raw, deadline, token, owner, *rest in snap["leases"]:
        lease = grant(lid, part, consumer, np.frombuffer(raw, dtype=np.int64).copy(), deadline=deadline - wall_offset,
                      token=token, owner=owner)
        if rest:
            lease.rest = tuple(rest[0])
    for w, keys in snap["put_keys"]:  # (a commit of new samples as its range; older snapshots: every index)
        kept = cat.put_keys[w] = Recent(PUT_KEYS_KEPT, PUT_KEYS_CELLS)
        for k, v in keys:
            kept.add(k, _kept_in(v))
    for tok, part, cols, v in snap.get("tokens", ()):  # (older snapshots kept none)
        cat.tokens.add(tok, (part, tuple(cols), _kept_in(v)))


def _kept_out(v: np.ndarray | range) -> list[int] | bytes:
    """Remembered indexes (`catalog.kept_as`) as a snapshot holds them: a range as [start, stop]."""
    return [v.start, v.stop] if isinstance(v, range) else indexes_of(v).tobytes()


def _kept_in(v: list[int] | bytes) -> np.ndarray | range:
    return range(v[0], v[1]) if isinstance(v, list) else np.frombuffer(v, dtype=np.int64).copy()


def check_version(snap: dict) -> None:
    if snap.get("version") not in (1, 2):
        raise DockValueError(f"controller snapshot version {snap.get('version')!r} is not supported")
