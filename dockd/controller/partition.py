"""Partition state: per partition, flat numpy arrays indexed by sample index, and per consumer
and column set (a *subscription*) a bitmap of the samples that request could take right now.

    ready      uint64   one bit per column (up to 64 columns per partition)
    loc[col]   uint16   warehouse id holding that column of the sample
    rloc[col]  uint16   warehouse id holding its replica (--replicas 2; see `replicas`)
    state[c]   uint8    per consumer: FREE, LEASED, TAKEN or LOST

    gone       bool     deleted (by delete or retirement): never handed out again
    tags[name] int64    per-sample integer tags (e.g. a rollout's age)
    changed    int64    the partition's change count when the sample was last written, tagged or
                        deleted (`touch`); made by the first listing of changes (dockd.controller.changes)

An `Eligible` bitmap (`eligible`) keeps a count per block of 1024, so an acquire walks the
non-empty blocks in order: its cost grows with the batch size and n/1024, not
with the partition. Eligibility is kept exact on every commit, lease, confirm
and release, so the number of ready samples is always known without a scan.

Consumers and their column sets cost the controller memory but no warehouse
room: a byte per sample of the partition for each consumer (`state`) and for
each column set it reads (a subscription's bitmap). Both are bounded dock-wide
(`Cells`), and a consumer keeps the bitmaps of its MAX_VIEWS most recently used
column sets only; a get with another drops the least recently used one (built
again, in one pass over the partition, when it is asked for again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from dockd import limits
from dockd.controller.eligible import FEW, Eligible
from dockd.errors import DockFull, DockValueError

FREE, LEASED, TAKEN, LOST = 0, 1, 2, 3
NO_WAREHOUSE = 0xFFFF
LOST_WAREHOUSE = 0xFFFE  # a (sample, column) whose warehouse rejoined without it
PENDING_WAREHOUSE = 0xFFFD  # in rloc: a replica on its way (see replicas)
MAX_COLUMNS = 64
MAX_TAGS = 16
VERSION_TAG = "version"  # the reserved tag holding each sample's policy version (put(version=...))
INT64_MAX = (1 << 63) - 1
#: Column sets (with or without groups) one consumer keeps an eligibility bitmap for.
MAX_VIEWS = 8
#: The dock's per-consumer memory (`Cells`) is bounded to this many bytes per sample of --max-samples.
CELLS_PER_SAMPLE = 16
#: Samples a partition's arrays are first made for (at its first sample; an empty partition has none).
FIRST_CAPACITY = 1024
#: A partition's epoch names it in this controller process: a change cursor of another epoch (a
#: partition cleared and made again, a restarted controller) is not one of its own.
_PROCESS = os.urandom(4).hex()
_EPOCHS = itertools.count(1)


@dataclasses.dataclass(slots=True)
class _Sub:
    mask: int
    groups: bool
    eligible: Eligible
    rng: np.random.Generator | None = None


class Cells:
    """The controller's per-consumer memory across the dock, in bytes: each consumer of a partition keeps
    a byte per sample of the partition's capacity, and so does each column set it reads. A request that
    would take it past `limit` (None: no bound) is refused before anything changes."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int, why: str) -> None:
        if n > 0 and self.limit is not None and self.used + n > self.limit:
            raise DockFull(
                f"{why} would take {_mib(n)} of controller memory; the dock's consumers already keep {_mib(self.used)} "
                f"(a byte per sample of a partition for each consumer name and each set of columns it reads) and "
                f"may keep {_mib(self.limit)} ({CELLS_PER_SAMPLE} bytes per sample of --max-samples). Let the workers "
                "of one pipeline stage share one consumer name, read the same columns in each get, or clear "
                "finished partitions")
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n

    @contextlib.contextmanager
    def unbounded(self) -> Iterator[None]:
        """Counted but never refused meanwhile: rebuilding what the dock held already (a restart)."""
        limit, self.limit = self.limit, None
        try:
            yield
        finally:
            self.limit = limit


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


class _Consumer:
    __slots__ = ("state", "subs", "taken", "leased")

    def __init__(self, capacity: int) -> None:
        self.state = np.zeros(capacity, dtype=np.uint8)
        self.subs: dict[tuple[int, bool], _Sub] = {}
        self.taken = 0
        self.leased = 0


class _Partition:
    """One partition's metadata. Its per-sample arrays are made for FIRST_CAPACITY samples by its first
    reserve and doubled as it grows; an empty one (created, sealed, or never written) holds none, so
    the dock's MAX_PARTITIONS empty partitions cost the controller about 1 KiB each."""

    __slots__ = ("name", "group_size", "cells", "size", "capacity", "ready", "columns", "loc", "rloc", "consumers",
                 "nbytes", "recovered", "gone", "deleted", "tags", "sealed", "retire", "version", "max_staleness",
                 "retire_stale", "max_pending", "stale_retired", "epoch", "seq", "changed")

    def __init__(self, name: str, group_size: int, cells: Cells | None = None) -> None:
        self.name = name
        self.group_size = group_size
        self.cells = cells if cells is not None else Cells()  # (the dock's, once a Catalog holds it)
        self.size = 0
        self.capacity = 0  # (arrays are made by the first reserve: an empty partition holds none)
        self.ready = np.zeros(0, dtype=np.uint64)
        self.columns: dict[str, int] = {}
        self.loc: dict[str, np.ndarray] = {}
        self.rloc: dict[str, np.ndarray] = {}  # made for a column once it has a replica
        self.consumers: dict[str, _Consumer] = {}
        self.nbytes: dict[int, int] = {}
        self.recovered = False  # rebuilt from warehouse inventories: consumer progress before it is unknown
        self.gone = np.zeros(0, dtype=bool)
        self.deleted = 0
        self.tags: dict[str, np.ndarray] = {}
        self.sealed = False
        self.retire: tuple[str, ...] = ()
        # asynchronous RL: the trainer's policy version, the staleness gets allow by default (-1: no
        # bound), whether set_version deletes what it makes stale, and how many samples may wait
        # for the partition's consumers before puts of new ones wait (0: no bound)
        self.version = 0
        self.max_staleness = -1
        self.retire_stale = False
        self.max_pending = 0
        self.stale_retired = 0
        self.epoch = f"{_PROCESS}.{next(_EPOCHS)}"
        self.seq = 0  # changes counted (once `changed` is kept)
        self.changed: np.ndarray | None = None

    # -- layout ---------------------------------------------------------------
    def reserve(self, n: int) -> None:
        need = self.size + n
        if need <= self.capacity:
            return
        cap = max(self.capacity, FIRST_CAPACITY)
        while cap < need:
            cap *= 2
        self.cells.take(self.cells_held(cap) - self.cells_held(), f"growing partition {self.name!r} to {cap} samples")
        self.ready = _grown(self.ready, cap)
        self.gone = _grown(self.gone, cap)
        if self.changed is not None:
            self.changed = _grown(self.changed, cap)
        for name, arr in self.tags.items():
            self.tags[name] = _grown(arr, cap)
        for locs in (self.loc, self.rloc):
            for col, arr in locs.items():
                locs[col] = _grown(arr, cap, fill=NO_WAREHOUSE)
        for cons in self.consumers.values():
            cons.state = _grown(cons.state, cap)
            for sub in cons.subs.values():
                sub.eligible.grow(cap // self.group_size if sub.groups else cap)
        self.capacity = cap

    def cells_held(self, capacity: int | None = None) -> int:
        """Bytes of per-consumer memory this partition keeps (at `capacity`, default its own)."""
        cap = self.capacity if capacity is None else capacity
        grouped = plain = 0
        for c in self.consumers.values():
            for s in c.subs.values():
                grouped += s.groups
                plain += not s.groups
        return cap * (len(self.consumers) + plain) + cap // self.group_size * grouped

    def ready_for(self, cons: _Consumer) -> int:
        """Samples `cons` could take now: the most of any column set it has asked for."""
        return max((s.eligible.total * (self.group_size if s.groups else 1) for s in cons.subs.values()), default=0)

    def tag(self, name: str, *, create: bool = False) -> np.ndarray:
        arr = self.tags.get(name)
        if arr is None:
            if not create:
                raise DockValueError(f"partition {self.name!r} has no tag {name!r}; its tags: {sorted(self.tags)}")
            if len(self.tags) >= MAX_TAGS:
                raise DockValueError(f"partition {self.name!r} already has {MAX_TAGS} tags; cannot add {name!r}")
            if not isinstance(name, str) or not name.isidentifier():
                raise DockValueError(f"a tag name is an identifier such as 'age', got {name!r}")
            arr = self.tags[name] = np.zeros(self.capacity, dtype=np.int64)
        return arr

    def tag_values(self, name: str, idx: np.ndarray) -> np.ndarray:
        """A tag's values for samples idx; the version tag reads 0 until a put sets one."""
        if name == VERSION_TAG and name not in self.tags:
            return np.zeros(len(idx), dtype=np.int64)
        values: np.ndarray = self.tag(name)[idx]
        return values

    def consumers_of(self) -> list[_Consumer | None]:
        """The consumers pacing and staleness wait for: those named by retire_when_consumed_by
        (None for one that never asked), else every consumer that asked for samples."""
        if self.retire:
            return [self.consumers.get(c) for c in self.retire]
        return list(self.consumers.values())

    def track_changes(self) -> np.ndarray:
        """The per-sample change counts, kept from now on (each sample starts unchanged)."""
        if self.changed is None:
            self.changed = np.zeros(self.capacity, dtype=np.int64)
        return self.changed

    def touch(self, idx: np.ndarray | Sequence[int]) -> None:
        """Samples idx were written, tagged, deleted or unwritten: one more change of the partition
        (counted only once someone lists changes)."""
        if self.changed is not None and len(idx):
            self.seq += 1
            self.changed[idx] = self.seq

    def live(self) -> np.ndarray:
        """Per sample: not deleted, and at least one column written."""
        n = self.size
        live: np.ndarray = ~self.gone[:n] & (self.ready[:n] != 0)
        return live

    def waiting_mask(self) -> np.ndarray:
        """Per sample: live and not yet handed out (leased or taken) to every one of its consumers
        (with no consumer yet: every live sample)."""
        n = self.size
        mask = self.live()
        conss = self.consumers_of()
        present = [c for c in conss if c is not None]
        if conss and len(present) == len(conss):
            free = np.zeros(n, dtype=bool)
            for c in present:
                free |= c.state[:n] == FREE
            mask &= free
        return mask

    def most_behind(self) -> tuple[str, int] | None:
        """The consumer max_pending waits for most (of consumers_of's): its name and how many live
        samples are not yet handed to it (one named by retire_when_consumed_by that never asked:
        all of them); None without such consumers."""
        live = self.live()
        counts = {name: int(np.count_nonzero(live if c is None else live & (c.state[: self.size] == FREE)))
                  for name, c in ((n, self.consumers.get(n)) for n in (self.retire or self.consumers))}
        return max(counts.items(), key=lambda kv: kv[1], default=None)

    def pending(self) -> int:
        """Samples not yet handed to all its consumers: what max_pending bounds."""
        return int(np.count_nonzero(self.waiting_mask())) if self.size else 0

    def stale_mask(self) -> np.ndarray:
        """Per sample: waiting for a consumer but staler than max_staleness allows."""
        n = self.size
        if self.max_staleness < 0 or not n:
            return np.zeros(n, dtype=bool)
        versions = self.tag_values(VERSION_TAG, np.arange(n, dtype=np.int64))
        return self.waiting_mask() & (versions < self.version - self.max_staleness)

    def bit(self, column: str) -> int:
        b = self.columns.get(column)
        if b is None:
            if len(self.columns) >= MAX_COLUMNS:
                raise DockValueError(
                    f"partition {self.name!r} already has {MAX_COLUMNS} columns; "
                    f"cannot add {column!r}. Pack related values into one column or use another partition."
                )
            b = self.columns[column] = len(self.columns)
            self.loc[column] = np.full(self.capacity, NO_WAREHOUSE, dtype=np.uint16)
        return b

    def write(self, columns: Sequence[str], bits: Sequence[int], idx: np.ndarray, warehouse: int) -> int:
        """Record `warehouse` as the holder of `columns` (their `bits`) of samples idx and mark those
        columns ready; returns the columns' bit mask."""
        newbits = 0
        for b in bits:
            newbits |= 1 << b
        if len(idx) <= FEW:  # (one sample at a time: numpy calls on tiny arrays cost more)
            few = idx.tolist()
            for c in columns:
                loc = self.loc[c]
                for i in few:
                    loc[i] = warehouse
            ready = self.ready
            for i in few:
                ready[i] = ready.item(i) | newbits
        else:
            for c in columns:
                self.loc[c][idx] = warehouse
            self.ready[idx] |= np.uint64(newbits)
        self.touch(idx)
        return newbits

    def locations(self, columns: Sequence[str], idx: np.ndarray) -> np.ndarray:
        """uint16 [len(columns), len(idx)]: the warehouse holding each column of samples idx."""
        if len(idx) <= FEW:
            few = idx.tolist()
            return np.array([[self.loc[c].item(i) for i in few] for c in columns], dtype=np.uint16).reshape(
                len(columns), len(few))
        return np.stack([self.loc[c][idx] for c in columns])

    def mask_of(self, columns: Iterable[str]) -> int | None:
        """The bit mask of known columns, or None if any column is unknown."""
        mask = 0
        for c in columns:
            b = self.columns.get(c)
            if b is None:
                return None
            mask |= 1 << b
        return mask

    # -- eligibility ------------------------------------------------------------
    def _sample_ok(self, cons: _Consumer, mask: int, idx: np.ndarray) -> np.ndarray:
        m = np.uint64(mask)
        ok: np.ndarray = ((self.ready[idx] & m) == m) & (cons.state[idx] == FREE)
        return ok

    def refresh(self, cons: _Consumer, idx: np.ndarray, subs: Iterable[_Sub] | None = None) -> None:
        """Recompute eligibility of samples idx (and their groups) in the given subscriptions."""
        few = idx.tolist() if len(idx) <= FEW else None
        for sub in cons.subs.values() if subs is None else subs:
            if few is not None and (not sub.groups or len(few) * self.group_size <= FEW):
                self._refresh_few(cons, few, sub)
            elif sub.groups:
                gs = self.group_size
                groups = np.unique(idx // gs)
                members = (groups[:, None] * gs + np.arange(gs)).ravel()
                ok = self._sample_ok(cons, sub.mask, members).reshape(len(groups), gs).all(axis=1)
                sub.eligible.set(groups[ok])
                sub.eligible.clear(groups[~ok])
            else:
                ok = self._sample_ok(cons, sub.mask, idx)
                sub.eligible.set(idx[ok])
                sub.eligible.clear(idx[~ok])

    def _refresh_few(self, cons: _Consumer, idx: list[int], sub: _Sub) -> None:
        """refresh for a few samples, one at a time (numpy calls on tiny arrays cost more)."""
        ready, state, m = self.ready, cons.state, sub.mask
        if sub.groups:
            gs = self.group_size
            units = sorted({i // gs for i in idx})
            ok = [all(ready.item(k) & m == m and state.item(k) == FREE for k in range(g * gs, g * gs + gs))
                  for g in units]
        else:
            units = idx
            ok = [ready.item(i) & m == m and state.item(i) == FREE for i in idx]
        sub.eligible.flip([u for u, y in zip(units, ok) if y], [u for u, y in zip(units, ok) if not y])

    def taken_out(self, cons: _Consumer, idx: np.ndarray) -> None:
        """Samples idx just left the pool of `cons`: no subscription of it may offer them (or their groups)."""
        for sub in cons.subs.values():
            sub.eligible.clear(np.unique(idx // self.group_size) if sub.groups else idx)

    def subscription(self, cons: _Consumer, mask: int, groups: bool) -> _Sub:
        """The eligibility of `cons` for this column set; its most recently used MAX_VIEWS are kept."""
        key = (mask, groups)
        subs = cons.subs
        sub = subs.pop(key, None)
        if sub is None:
            if len(subs) >= MAX_VIEWS:
                old = subs.pop(next(iter(subs)))
                self.cells.give(len(old.eligible.bits))
            units = self.capacity // self.group_size if groups else self.capacity
            self.cells.take(units, f"another set of columns read by a consumer of partition {self.name!r}")
            sub = _Sub(mask, groups, Eligible(units))
            if self.size:
                self.refresh(cons, np.arange(self.size, dtype=np.int64), [sub])
        subs[key] = sub  # (the most recently used last)
        return sub

    def consumer(self, name: str) -> _Consumer:
        cons = self.consumers.get(name)
        if cons is None:
            if len(self.consumers) >= limits.MAX_CONSUMERS:
                raise DockValueError(
                    f"partition {self.name!r} has {len(self.consumers)} consumers, the most it takes; a consumer is a "
                    "pipeline stage (reference, reward, actor_train), and the workers of one stage share its name")
            self.cells.take(self.capacity, f"consumer {name!r} of partition {self.name!r}")
            cons = self.consumers[name] = _Consumer(self.capacity)
        return cons

    def drop(self, name: str) -> _Consumer | None:
        """Forget consumer `name` (its state and column sets; the dock's cells get their memory back);
        returns it, or None if the partition had no such consumer."""
        cons = self.consumers.pop(name, None)
        if cons is not None:
            self.cells.give(len(cons.state) + sum(len(s.eligible.bits) for s in cons.subs.values()))
        return cons

    # -- reporting ----------------------------------------------------------------
    def stats(self) -> dict:
        n = self.size
        ready = self.ready[:n]
        live = self.live()
        return {
            "name": self.name,
            "samples": n,
            "group_size": self.group_size,
            "columns": {
                c: int(np.count_nonzero((ready >> np.uint64(b)) & np.uint64(1))) for c, b in self.columns.items()
            },
            "consumers": {name: {"taken": c.taken, "leased": c.leased, "ready": self.ready_for(c),
                                 "pending": int(np.count_nonzero(live & (c.state[:n] == FREE)))}
                          for name, c in self.consumers.items()},
            "recovered": self.recovered,
            "deleted": self.deleted,
            "sealed": self.sealed,
            "retire_when_consumed_by": list(self.retire),
            "tags": sorted(self.tags),
            "version": self.version,
            "max_staleness": self.max_staleness,
            "retire_stale": self.retire_stale,
            "max_pending": self.max_pending,
            "pending": self.pending(),
            "stale": int(np.count_nonzero(self.stale_mask())),
            "stale_retired": self.stale_retired,
        }

    def metadata_bytes(self) -> int:
        """Bytes of metadata held for this partition (all arrays)."""
        total = self.ready.nbytes + self.gone.nbytes + sum(a.nbytes for a in self.loc.values())
        total += self.changed.nbytes if self.changed is not None else 0
        total += sum(a.nbytes for a in self.rloc.values())
        total += sum(a.nbytes for a in self.tags.values())
        for cons in self.consumers.values():
            total += cons.state.nbytes
            for sub in cons.subs.values():
                total += sub.eligible.bits.nbytes + sub.eligible.blocks.nbytes
        return total


def _check_tags(tags: Mapping[str, Sequence[int] | np.ndarray], n: int) -> None:
    """Tag values: one for all n samples, or one each (a replayed record's are arrays)."""
    for name, values in tags.items():
        k = len(values)
        if k not in (1, n):
            raise DockValueError(f"tag {name!r} has {k} values for {n} samples; give one value, or one per sample")
        if name == VERSION_TAG and k and min(values) < 0:
            raise DockValueError(f"a policy version is an int >= 0, got {min(values)}")



def _grown(arr: np.ndarray, cap: int, fill: int = 0) -> np.ndarray:
    out = np.full(cap, fill, dtype=arr.dtype)
    out[: len(arr)] = arr
    return out
