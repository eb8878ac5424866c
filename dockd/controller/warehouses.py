"""Where values live, and warehouses that leave and come back: values on a warehouse that
left the dock are lost (DockDataLost when met), and a rejoining warehouse's inventory is
reconciled with what the controller recorded."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import numpy as np

from dockd.controller import replica_map as replicas
from dockd.controller.catalog import Catalog
from dockd.controller.partition import LOST, LOST_WAREHOUSE, NO_WAREHOUSE, PENDING_WAREHOUSE, _Consumer, _Partition
from dockd.errors import DockDataLost, DockNotFound, DockValueError

logger = logging.getLogger(__name__)


DURABLE_REJOIN = "durable"
"""`rejoin(known=...)` for a known warehouse with a data dir (journaled as is): what it lacks was never acknowledged."""


@dataclasses.dataclass(slots=True)
class Inventory:
    """What a warehouse holds of one partition: sorted sample indexes per column."""

    group_size: int
    nbytes: int
    columns: dict[str, np.ndarray]


def check_lost(cat: Catalog, part: _Partition, cons: _Consumer, columns: Sequence[str], idx: np.ndarray,
               locs: np.ndarray) -> None:
    dead = np.isin(locs, np.fromiter(cat.dead_warehouses, dtype=np.uint16))
    if not dead.any():
        return
    lost_samples = dead.any(axis=0)
    lost_idx = idx[lost_samples]
    lost_cols = [c for c, row in zip(columns, dead) if row.any()]
    cons.state[lost_idx] = LOST
    part.taken_out(cons, lost_idx)
    raise DockDataLost(
        f"{len(lost_idx)} samples of partition {part.name!r} are lost: columns {lost_cols} lived on "
        f"warehouse(s) {sorted(set(locs[dead].tolist()))}, which left the dock. Indexes: "
        f"{lost_idx[:16].tolist()}{' ...' if len(lost_idx) > 16 else ''}. Re-put them or skip them.",
        indexes=lost_idx.tolist(),
        columns=lost_cols,
    )

def locate(cat: Catalog, partition: str, indexes: Sequence[int], columns: Sequence[str]) -> np.ndarray:
    """Warehouse ids (len(columns) x len(indexes)) holding written values; takes nothing."""
    part = cat.partitions.get(partition)
    if part is None:
        raise DockNotFound(f"partition {partition!r} does not exist")
    if not columns:
        raise DockValueError("columns must name at least one column")
    idx = np.asarray(indexes, dtype=np.int64).reshape(-1)
    bad = idx[(idx < 0) | (idx >= part.size)]
    if len(bad):
        raise DockNotFound(f"sample indexes {bad[:8].tolist()} do not exist in partition {partition!r}")
    rows = []
    for c in columns:
        b = part.columns.get(c)
        missing = idx if b is None else idx[(part.ready[idx] >> np.uint64(b)) & np.uint64(1) == 0]
        if len(missing):
            raise DockNotFound(
                f"column {c!r} is not written for samples {missing[:8].tolist()} of partition {partition!r}"
            )
        rows.append(part.loc[c][idx])
    locs = np.stack(rows) if rows else np.empty((0, len(idx)), dtype=np.uint16)
    if cat.dead_warehouses:
        dead = np.isin(locs, np.fromiter(cat.dead_warehouses, dtype=np.uint16))
        if dead.any():
            raise DockDataLost(
                f"samples {idx[dead.any(axis=0)][:16].tolist()} of partition {partition!r} lived on a warehouse "
                "that left the dock",
                indexes=idx[dead.any(axis=0)].tolist(),
                columns=[c for c, row in zip(columns, dead) if row.any()],
            )
    return locs

def warehouse_lost(cat: Catalog, warehouse: int) -> dict[str, dict[str, np.ndarray]]:
    """`warehouse` left the dock: its values with a replica move to it, those whose copy was on its
    way become unwritten (returned: see replicas.promote), the others are lost (DockDataLost when met)."""
    unwritten = replicas.promote(cat, warehouse)
    cat.dead_warehouses.add(warehouse)
    cat.put_keys.pop(warehouse, None)
    for part in cat.partitions.values():
        part.nbytes.pop(warehouse, None)
    return unwritten

def rejoin(cat: Catalog, warehouse: int, inventory: Mapping[str, Inventory], *, known: bool | str,
           lost: Mapping[str, Inventory] | bool | None = None) -> list[str]:
    """Reconcile what a rejoining warehouse holds with what this controller records.

    `known`: the controller remembers this warehouse (a journal, or it never
    went away). Then the records win: (sample, column)s recorded on the
    warehouse that it no longer holds become lost (DockDataLost when met),
    and partitions it holds that the dock no longer has are returned, for
    the warehouse to free. `known` == DURABLE_REJOIN: a warehouse with a data dir
    that restarted; it wrote every put before acknowledging it, so what it no
    longer holds was committed but never acknowledged (the kill came between
    the commit and the file): those values become unwritten again (their
    writer was told the put failed, and may write them again), not lost;
    except the values in `lost`, whose files it dropped as damaged at start
    (True: some dropped file was too damaged to say what it held, so every
    value it lacks): those are read from their replica where a live one
    holds them, else lost (DockDataLost when met).
    Otherwise (a restart without a state dir) the
    inventory is the truth: partitions are rebuilt from it, marked
    `recovered` (consumer progress before the restart is unknown); a value
    that another warehouse already holds under the same index stays there,
    and the rejoining one's copy is ignored (logged).
    """
    cat.dead_warehouses.discard(warehouse)
    if not known:
        _rebuild(cat, warehouse, inventory)
        return []
    for part in cat.partitions.values():
        _reconcile(cat, part, warehouse, inventory.get(part.name), known == DURABLE_REJOIN, lost)
    return [name for name in inventory if name not in cat.partitions]


def _reconcile(cat: Catalog, part: _Partition, warehouse: int, held: Inventory | None, durable: bool,
               lost: Mapping[str, Inventory] | bool | None) -> None:
    """A known warehouse rejoins holding `held` of `part` (see rejoin): the records win."""
    for col, loc in part.loc.items():
        mine = np.flatnonzero(loc[: part.size] == warehouse)
        if held is not None and col in held.columns:
            mine = mine[~np.isin(mine, held.columns[col], assume_unique=True)]
        if len(mine) and durable and lost:
            gone = mine if lost is True else _among(lost, part.name, col, mine)
            if len(gone):
                mine = mine[~np.isin(mine, gone, assume_unique=True)]
                _lost_on_disk(cat, part, col, gone, warehouse, lost is True)
        if len(mine) and durable:
            loc[mine] = NO_WAREHOUSE
            part.ready[mine] &= ~np.uint64(1 << part.columns[col])
            part.touch(mine)
            for cons in part.consumers.values():
                part.refresh(cons, mine)
            logger.warning("[controller] warehouse %d restarted from its data dir without %d values of column "
                           "%r of partition %r, committed but never acknowledged; they are unwritten again",
                           warehouse, len(mine), col, part.name)
        elif len(mine):
            loc[mine] = LOST_WAREHOUSE
            cat.dead_warehouses.add(LOST_WAREHOUSE)
            logger.warning("[controller] warehouse %d rejoined without %d values of column %r of "
                           "partition %r; they are lost", warehouse, len(mine), col, part.name)
    for col, rl in part.rloc.items():  # replicas it no longer holds are made again elsewhere
        mine = np.flatnonzero(rl[: part.size] == warehouse)
        if held is not None and col in held.columns:
            mine = mine[~np.isin(mine, held.columns[col], assume_unique=True)]
        rl[mine] = NO_WAREHOUSE
    if held is None:
        part.nbytes.pop(warehouse, None)
        return
    part.nbytes[warehouse] = held.nbytes
    if part.deleted:  # samples deleted while it was away: it frees them now
        held_idx = [np.asarray(v, dtype=np.int64) for v in held.columns.values()]
        stale = np.unique(np.concatenate(held_idx)) if held_idx else np.empty(0, dtype=np.int64)
        stale = stale[stale < part.size]
        stale = stale[part.gone[stale]]
        if len(stale):
            cat.pending_frees.setdefault(part.name, {}).setdefault(warehouse, []).append(stale)


def _rebuild(cat: Catalog, warehouse: int, inventory: Mapping[str, Inventory]) -> None:
    """A warehouse the controller does not know rejoins (see rejoin): its inventory is the truth."""
    cat._samples = None
    for name, held in inventory.items():
        found = cat.partitions.get(name)
        if found is None:
            part = cat.partitions[name] = _Partition(name, held.group_size or 1, cat.cells)
        elif found.group_size != (held.group_size or 1):
            logger.error("[controller] warehouse %d holds partition %r with groups of %d, but the dock has groups "
                         "of %d; its copy is ignored", warehouse, name, held.group_size, found.group_size)
            continue
        else:
            part = found
        part.recovered = True
        top = max((int(ix[-1]) + 1 for ix in held.columns.values() if len(ix)), default=0)
        top = -(-top // part.group_size) * part.group_size
        if top > part.size:
            with cat.cells.unbounded():  # (samples the dock holds already: counted, never refused)
                part.reserve(top - part.size)
            part.size = top
        newbits, conflicts, changed = 0, 0, []
        for col, ix in held.columns.items():
            b = part.bit(col)
            ix = np.asarray(ix, dtype=np.int64)
            taken = (part.ready[ix] >> np.uint64(b)) & np.uint64(1) == 1
            conflicts += int(taken.sum())
            ix = ix[~taken]
            part.loc[col][ix] = warehouse
            part.ready[ix] |= np.uint64(1 << b)
            part.touch(ix)
            newbits |= 1 << b
            changed.append(ix)
        part.nbytes[warehouse] = part.nbytes.get(warehouse, 0) + held.nbytes
        if conflicts:
            logger.error("[controller] warehouse %d holds %d values of partition %r under indexes that were "
                         "written again after the controller restarted without a state dir; its copies are "
                         "ignored", warehouse, conflicts, name)
        if changed:
            idx = np.unique(np.concatenate(changed))
            for cons in part.consumers.values():
                subs = [s for s in cons.subs.values() if s.mask & newbits]
                if subs:
                    part.refresh(cons, idx, subs)


def _among(lost: Mapping[str, Inventory] | bool, partition: str, column: str, idx: np.ndarray) -> np.ndarray:
    held = lost.get(partition) if isinstance(lost, Mapping) else None
    ix = held.columns.get(column) if held is not None else None
    return idx[np.isin(idx, ix)] if ix is not None else idx[:0]


def _lost_on_disk(cat: Catalog, part: _Partition, column: str, idx: np.ndarray, warehouse: int, unknown: bool) -> None:
    """Values a warehouse restarted from its data dir without, their file dropped as damaged: where a live
    replica holds them it becomes their home (and the repair copies them again), the rest are lost."""
    loc, rl, moved = part.loc[column], part.rloc.get(column), 0
    if rl is not None:
        r = rl[idx]
        live = (r < PENDING_WAREHOUSE) & ~np.isin(r, np.fromiter(cat.dead_warehouses, dtype=np.uint16))
        loc[idx[live]] = r[live]
        rl[idx[live]] = NO_WAREHOUSE
        moved, idx = int(live.sum()), idx[~live]
    if len(idx):
        loc[idx] = LOST_WAREHOUSE
        cat.dead_warehouses.add(LOST_WAREHOUSE)
    why = ("it dropped a file of its data dir too damaged to say what it held" if unknown else
           "the file(s) of its data dir holding them failed their check and were moved aside")
    logger.error("[controller] warehouse %d restarted without %d values of column %r of partition %r: %s; %d are "
                 "read from their replicas, %d are lost (DockDataLost)", warehouse, moved + len(idx), column,
                 part.name, why, moved, len(idx))
