"""Replicas (`--replicas 2`): a second warehouse holding a copy of each written value.

Per partition and column, `rloc[col]` (uint16, like `loc`) names the warehouse holding the
value's replica: NO_WAREHOUSE (none), PENDING (a copy is on its way: the warehouse that
stored the value is copying it, or the controller asked it to), or a warehouse id. The
home warehouse is the one in `loc`; readers go there.

    put       the controller answers a warehouse's commit with the warehouse to copy the
              put to (`target`: the next joined warehouse after the home one, in id order)
              and marks the values PENDING; the home stores the put, sends the copy, and the
              replica warehouse commits it (`commit_replica`) before the home answers the writer
    loss      `promote`: values whose home left the dock and whose replica is live move to
              the replica, which becomes their home; values whose replica left lose it
    repair    `missing`: values with a live home and no replica (after a loss, a failed copy,
              or a put made while no second warehouse was joined); the service asks their
              home to copy them to a target, marking them PENDING until it commits them

Marks that stay PENDING longer than the service's deadline (a copy that never arrived)
become NO_WAREHOUSE again and are repaired. PENDING is never journaled: a restarted
controller sees those values without a replica and repairs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from dockd.controller.catalog import Catalog
from dockd.controller.partition import NO_WAREHOUSE, _Partition
from dockd.controller.partition import PENDING_WAREHOUSE as PENDING
from dockd.errors import DockNotFound, DockValueError

_MARKS = PENDING  # ids at or above are markers (pending, lost, none), not warehouses


def rloc(part: _Partition, column: str) -> np.ndarray:
    """The replica locations of one column (made on first use, as long as the partition's arrays)."""
    arr = part.rloc.get(column)
    if arr is None:
        arr = part.rloc[column] = np.full(part.capacity, NO_WAREHOUSE, dtype=np.uint16)
    return arr


def target(joined: Sequence[int], home: int) -> int | None:
    """The warehouse that keeps the replicas of `home`'s values: the next joined one after it in
    id order (wrapping around), so that each warehouse's replicas go to one other; None when no
    other warehouse is joined."""
    others = sorted(w for w in joined if w != home)
    if not others:
        return None
    for w in others:
        if w > home:
            return w
    return others[0]


def mark_pending(part: _Partition, columns: Iterable[str], idx: np.ndarray) -> None:
    """A copy of these values is on its way (only values without a replica yet)."""
    for c in columns:
        arr = rloc(part, c)
        sel = idx[arr[idx] == NO_WAREHOUSE]
        arr[sel] = PENDING


def unmark(part: _Partition, columns: Iterable[str], idx: np.ndarray) -> None:
    """A copy that did not arrive: the values are without a replica again (and get repaired)."""
    for c in columns:
        arr = part.rloc.get(c)
        if arr is not None:
            sel = idx[arr[idx] == PENDING]
            arr[sel] = NO_WAREHOUSE


def commit_replica(cat: Catalog, partition: str, columns: Sequence[str], *, warehouse: int,
                   indexes: Sequence[int] | np.ndarray, nbytes: int = 0, put_id: int = 0) -> np.ndarray:
    """Record that `warehouse` holds a copy of written values; returns the indexes recorded (those
    deleted meanwhile are not: the warehouse frees them). From the values' own warehouse it says
    their copy could not be made: they have no replica yet (the repair makes one). Refused for
    values not written, or with another replica already."""
    done = cat.recall(warehouse, put_id)
    if done is not None:
        return done
    part = cat.part(partition)
    idx = np.asarray(indexes, dtype=np.int64).reshape(-1)
    if not len(idx):
        raise DockValueError("a replica names the samples it copies")
    bad = idx[(idx < 0) | (idx >= part.size)]
    if len(bad):
        raise DockNotFound(f"sample indexes {bad[:8].tolist()} do not exist in partition {partition!r}")
    idx = idx[~part.gone[idx]]  # (a consumer may have taken and retired them while they were copied)
    if not len(idx):
        cat.remember(warehouse, put_id, idx)
        return idx
    home = [part.loc[c][idx] == warehouse if c in part.loc else np.zeros(len(idx), bool) for c in columns]
    if all(h.all() for h in home):  # the copy failed: repaired later
        unmark(part, columns, idx)
        return idx
    for c, h in zip(columns, home):
        b = part.columns.get(c)
        unwritten = idx if b is None else idx[(part.ready[idx] >> np.uint64(b)) & np.uint64(1) == 0]
        if len(unwritten):
            raise DockNotFound(f"column {c!r} of samples {unwritten[:8].tolist()} of partition {partition!r} is not "
                               "written: there is nothing to replicate")
        if h.any():
            raise DockValueError(f"warehouse {warehouse} holds column {c!r} of some of these samples already; a "
                                 "replica lives on another warehouse")
        have = rloc(part, c)[idx]
        other = (have < _MARKS) & (have != warehouse)
        if other.any():
            raise DockValueError(f"column {c!r} of samples {idx[other][:8].tolist()} of partition {partition!r} "
                                 f"already has its replica on warehouse {int(have[other][0])}")
    for c in columns:
        part.rloc[c][idx] = warehouse
    part.nbytes[warehouse] = part.nbytes.get(warehouse, 0) + nbytes
    cat.remember(warehouse, put_id, idx)
    return idx


def promote(cat: Catalog, warehouse: int) -> dict[str, dict[str, np.ndarray]]:
    """`warehouse` left the dock: its values with a live replica move there; replicas it held are
    gone. Its values whose copy was still on its way were never acknowledged (a copy that fails is
    reported before the put is answered): they become unwritten, not lost (returned, partition ->
    column -> indexes, for the journal: `unwrite` replays it)."""
    dead = np.fromiter(cat.dead_warehouses | {warehouse}, dtype=np.uint16)
    unwritten: dict[str, dict[str, np.ndarray]] = {}
    for part in cat.partitions.values():
        n = part.size
        for col, arr in part.rloc.items():
            loc, rl = part.loc[col][:n], arr[:n]
            rl[rl == warehouse] = NO_WAREHOUSE
            up = np.flatnonzero((loc == warehouse) & (rl < _MARKS) & ~np.isin(rl, dead))
            if len(up):
                loc[up] = rl[up]
                rl[up] = NO_WAREHOUSE
            cut = np.flatnonzero((loc == warehouse) & (rl == PENDING))
            if len(cut):
                unwritten.setdefault(part.name, {})[col] = cut
    unwrite(cat, unwritten)
    return unwritten


def unwrite(cat: Catalog, values: Mapping[str, Mapping[str, np.ndarray]]) -> None:
    """Values never acknowledged whose warehouse left: unwritten again (a re-send of their put writes them)."""
    for name, cols in values.items():
        part = cat.partitions.get(name)
        if part is None:
            continue
        for col, idx in cols.items():
            part.loc[col][idx] = NO_WAREHOUSE
            rloc(part, col)[idx] = NO_WAREHOUSE
            part.ready[idx] &= ~np.uint64(1 << part.columns[col])
            part.touch(idx)
            for cons in part.consumers.values():
                part.refresh(cons, idx)


def missing(part: _Partition, dead: set[int], live: set[int]) -> dict[tuple[int, str], np.ndarray]:
    """Written values without a replica whose home is live: (home, column) -> sample indexes."""
    out: dict[tuple[int, str], np.ndarray] = {}
    n = part.size
    if not n:
        return out
    for col, b in part.columns.items():
        loc = part.loc[col][:n]
        written = ((part.ready[:n] >> np.uint64(b)) & np.uint64(1)) == 1
        rl = part.rloc.get(col)
        without = written & ~part.gone[:n] & (loc < _MARKS)
        if rl is not None:
            without &= rl[:n] == NO_WAREHOUSE
        idx = np.flatnonzero(without)
        if not len(idx):
            continue
        for w in np.unique(loc[idx]).tolist():
            if w in live and w not in dead:
                out[(w, col)] = idx[loc[idx] == w]
    return out


def counts(part: _Partition) -> tuple[int, int]:
    """(values with a replica, written values without one and without a copy on its way) of a partition."""
    n = part.size
    have = lack = 0
    for col, b in part.columns.items():
        written = ((part.ready[:n] >> np.uint64(b)) & np.uint64(1)) == 1
        written &= part.loc[col][:n] < _MARKS
        rl = part.rloc.get(col)
        if rl is None:
            lack += int(np.count_nonzero(written))
            continue
        have += int(np.count_nonzero(written & (rl[:n] < _MARKS)))
        lack += int(np.count_nonzero(written & (rl[:n] == NO_WAREHOUSE)))
    return have, lack
