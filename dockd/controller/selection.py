"""Selection policies: which of a subscription's eligible samples a get hands out, in which
order. First in index order (the block counts of the eligibility bitmap make this O(batch)),
drawn at random (shuffle), filtered and ordered by tags (a scan of the bitmap), the samples
held on the client's own warehouse first (near), and the staleness bound of asynchronous RL
(a filter and an order on the version tag). Pure functions of a partition's state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dockd.controller.partition import FREE, INT64_MAX, LEASED, NO_WAREHOUSE, VERSION_TAG, _Consumer, _Partition, _Sub
from dockd.errors import DockDrained, DockValueError

Where = Mapping[str, tuple[int, int]]
"""A get's tag filter: tag name -> the [lo, hi] its values must lie in."""


def check_request(partition: str, consumer: str, columns: Sequence[str], count: int) -> None:
    """Refuse a get that names no partition, consumer or column, or asks for no sample."""
    if not partition:
        raise DockValueError("partition must be a non-empty string")
    if not consumer:
        raise DockValueError("consumer must be a non-empty string, e.g. 'actor_train'")
    if not columns:
        raise DockValueError("columns must name at least one column")
    if count < 1:
        raise DockValueError(f"count must be >= 1, got {count}")


def staleness_filter(part: _Partition, max_staleness: int | None, where: Where | None,
                     order_by: str) -> tuple[Where | None, str]:
    """A get's where and order_by with the staleness bound applied (the request's, else the
    partition's): versions >= version - bound, oldest version first unless it orders itself."""
    bound = part.max_staleness if max_staleness is None else max_staleness
    if bound < 0:
        return where, order_by
    lo = part.version - bound
    bounded = dict(where or {})
    old = bounded.get(VERSION_TAG)
    bounded[VERSION_TAG] = (max(lo, old[0]), old[1]) if old else (lo, INT64_MAX)
    return bounded, order_by or VERSION_TAG


def view(part: _Partition, consumer: str, columns: Sequence[str], count: int,
         groups: bool) -> tuple[int, _Consumer, _Sub, int] | None:
    """What a get of `columns` sees of a partition: (column mask, the consumer, its
    subscription, samples per unit), or None while one of the columns does not exist yet."""
    if groups and count % part.group_size:
        raise DockValueError(
            f"groups=True needs count to be a multiple of the group size {part.group_size} "
            f"of partition {part.name!r}, got {count}"
        )
    mask = part.mask_of(columns)
    if mask is None:
        return None
    cons = part.consumer(consumer)
    return mask, cons, part.subscription(cons, mask, groups), part.group_size if groups else 1


def pick(part: _Partition, consumer: str, mask: int, sub: _Sub, want: int, gs: int, columns: Sequence[str], *,
         partial: bool = False, where: Where | None = None, **how: Any) -> np.ndarray | None:
    """The sample indexes of up to `want` units to hand out; None to wait. Fewer than `want`
    only with `partial` or at the end of a sealed partition; DockDrained when nothing is left."""
    units, have = choose(part, sub, want, gs, where=where, columns=columns, **how)
    if have == 0 or (have < want and not partial):
        if not drained(part, part.consumers[consumer], mask, where):
            return None
        if have == 0:
            raise DockDrained(f"partition {part.name!r} is sealed and has nothing left for consumer "
                              f"{consumer!r} (columns {list(columns)})")
    return (units[:, None] * gs + np.arange(gs)).ravel() if gs > 1 else units


def choose(part: _Partition, sub: _Sub, want: int, gs: int, *, shuffle: bool = False, seed: int | None = None,
           where: Where | None = None, order_by: str = "", near: int | None = None,
           columns: Sequence[str] = ()) -> tuple[np.ndarray, int]:
    """Up to `want` units (samples, or groups of gs) `sub` could take, in hand-out order, and
    how many it could take in all."""
    # (fewer eligible than wanted: all of them go anyway; data on one warehouse: nothing to prefer)
    if near is not None and sub.eligible.total > want and len(part.nbytes) > 1:
        if not where and not order_by and not shuffle:
            return near_first(part, sub, want, gs, near, columns), sub.eligible.total
        units, have = choose(part, sub, sub.eligible.total, gs, shuffle=shuffle, seed=seed, where=where,
                             order_by=order_by)
        local = held_on(part, units * gs, near, columns)
        return np.concatenate([units[local], units[~local]])[:want], have
    if not where and not order_by:
        have = sub.eligible.total
        n = min(want, have)
        if shuffle:
            if sub.rng is None:
                sub.rng = np.random.default_rng(seed)
            return sub.eligible.sample(n, sub.rng), have
        return sub.eligible.first(n), have
    units = np.flatnonzero(sub.eligible.bits)
    if where:
        units = units[within(part, units * gs, where)]
    if order_by:
        desc = order_by.startswith("-")
        key = part.tag_values(order_by.lstrip("-"), units * gs)
        units = units[np.argsort(-key if desc else key, kind="stable")]
    elif shuffle:
        if sub.rng is None:
            sub.rng = np.random.default_rng(seed)
        units = sub.rng.permutation(units)
    return units[:want], len(units)


def held_on(part: _Partition, idx: np.ndarray, wid: int, columns: Sequence[str]) -> np.ndarray:
    """Which of idx have every one of `columns` on warehouse `wid` (a group goes by its first
    sample: a group is put in one piece)."""
    ok = np.ones(len(idx), dtype=bool)
    for c in columns:
        ok &= part.loc[c][idx] == wid
    return ok


def ready_by_warehouse(part: _Partition, sub: _Sub, gs: int, columns: Sequence[str],
                       where: Where | None = None) -> dict[int, int]:
    """Warehouse id -> how many samples `sub` could take now (within `where`) that have every one
    of `columns` on that warehouse: what a waiting near get could have without crossing a link."""
    if not sub.eligible.total:
        return {}
    units = np.flatnonzero(sub.eligible.bits)
    if where:
        units = units[within(part, units * gs, where)]
    idx = units * gs
    at = part.loc[columns[0]][idx]
    for c in columns[1:]:
        at = np.where(part.loc[c][idx] == at, at, NO_WAREHOUSE)
    wids, n = np.unique(at[at != NO_WAREHOUSE], return_counts=True)
    return dict(zip(wids.tolist(), (n * gs).tolist()))


def near_first(part: _Partition, sub: _Sub, want: int, gs: int, near: int, columns: Sequence[str]) -> np.ndarray:
    """`want` eligible units, those held on `near` first (in index order), then the first others.
    Scans the bitmap in chunks and stops once enough local units are found."""
    bits, step, need, got = sub.eligible.bits, 1 << 16, want, []
    for start in range(0, len(bits), step):
        u = np.flatnonzero(bits[start:start + step])
        if not len(u):
            continue
        u += start
        sel = u[held_on(part, u * gs, near, columns)][:need]
        got.append(sel)
        need -= len(sel)
        if not need:
            break
    local = np.concatenate(got) if got else np.empty(0, dtype=np.int64)
    if need:
        rest = sub.eligible.first(want + len(local))
        local = np.concatenate([local, rest[~np.isin(rest, local)][:need]])
    return local


def within(part: _Partition, idx: np.ndarray, where: Where) -> np.ndarray:
    """Which of idx have every tag of `where` in its [lo, hi]."""
    ok = np.ones(len(idx), dtype=bool)
    for name, (lo, hi) in where.items():
        vals = part.tag_values(name, idx)
        ok &= (vals >= lo) & (vals <= hi)
    return ok


def drained(part: _Partition, cons: _Consumer, mask: int, where: Where | None = None) -> bool:
    """Whether nothing more can become eligible for `cons` and these columns: the partition is
    sealed, none of the consumer's samples is leased (it could come back), and every sample
    still free for it is either deleted or ready already."""
    if not part.sealed:
        return False
    n = part.size
    state = cons.state[:n]
    if cons.leased and (state == LEASED).any():
        return False
    m = np.uint64(mask)
    pending = ~part.gone[:n] & (state == FREE) & ((part.ready[:n] & m) != m)
    if where and pending.any():
        pending &= within(part, np.arange(n, dtype=np.int64), where)
    return not pending.any()
