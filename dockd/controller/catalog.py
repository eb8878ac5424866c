"""The dock's partitions and their samples: commits (columns written, new samples
allocated, re-sent commits answered once), partition options, deletes and retirement, tags,
and the frees deletes leave for the warehouses. What it answers without changing anything
(listings, counts ready) is `reads`; leases and rounds are the controller's."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np

from dockd import limits
from dockd.controller.partition import (
    CELLS_PER_SAMPLE,
    FREE,
    INT64_MAX,
    LOST,
    NO_WAREHOUSE,
    PENDING_WAREHOUSE,
    TAKEN,
    Cells,
    _check_tags,
    _Partition,
)
from dockd.errors import DockFull, DockNotFound, DockValueError
from dockd.recent import Recent

PUT_KEYS_KEPT = 4096  # per warehouse: recent commits remembered so a re-sent one is applied once
PUT_KEYS_CELLS = 1 << 21  # ... holding at most this many explicit indexes (16 MiB; see dockd.recent)
TOKENS_KEPT = 16384  # per dock: recent puts' writer tokens, so a put re-sent to another warehouse is applied once
TOKENS_CELLS = 1 << 22  # ... holding at most this many explicit indexes (32 MiB)


def kept_as(idx: np.ndarray, consecutive: bool) -> np.ndarray | range:
    """A commit's indexes as remembered for its re-sends: a range when they are consecutive (new
    samples), so that the last puts of many samples each hold no memory per sample."""
    return range(int(idx[0]), int(idx[0]) + len(idx)) if consecutive and len(idx) else idx


def _token_cells(seen: tuple[str, tuple[str, ...], np.ndarray | range]) -> int:
    """What a remembered put costs `Catalog.tokens`: its indexes, when they are an array."""
    kept = seen[2]
    return len(kept) if isinstance(kept, np.ndarray) else 0


def indexes_of(kept: np.ndarray | range) -> np.ndarray:
    """Remembered indexes (see `kept_as`) as an int64 array."""
    return kept if isinstance(kept, np.ndarray) else np.arange(kept.start, kept.stop, dtype=np.int64)


class Catalog:
    """The partitions of one dock, at most `max_samples` samples in all (their metadata lives here)."""

    def __init__(self, max_samples: int) -> None:
        self.cells = Cells()  # the per-consumer memory of every partition held here (bounded with max_samples)
        self.max_samples = max_samples
        self._samples: int | None = None  # ... how many there are (None: count again)
        self.partitions: dict[str, _Partition] = {}
        self.dead_warehouses: set[int] = set()
        # per warehouse, put_id -> indexes of its recent commits (a re-sent commit is answered, not re-applied)
        self.put_keys: dict[int, Recent[np.ndarray | range]] = {}
        # writer token -> (partition, columns, indexes) of recent puts (see `stored` and `commit`)
        self.tokens: Recent[tuple[str, tuple[str, ...], np.ndarray | range]] = Recent(TOKENS_KEPT, TOKENS_CELLS,
                                                                                      _token_cells)
        # deleted samples whose data a warehouse still holds: partition -> warehouse -> index arrays
        # (the service sends the frees; replaying a journal refills it, and a second free is harmless)
        self.pending_frees: dict[str, dict[int, list[np.ndarray]]] = {}

    def commit(
        self,
        partition: str,
        columns: Sequence[str],
        *,
        warehouse: int,
        indexes: Sequence[int] | np.ndarray | None = None,
        new_count: int = 0,
        group_size: int = 1,
        nbytes: int = 0,
        put_id: int = 0,
        tags: Mapping[str, Sequence[int]] | None = None,
        token: int = 0,
        away: Collection[int] = (),
    ) -> np.ndarray:
        """Record that `warehouse` now holds `columns` of some samples; returns their indexes.

        With `indexes` None, allocates `new_count` new samples (groups of
        `group_size` consecutive indexes). Otherwise the samples must exist and
        none of `columns` may already be written for them. A commit whose
        (warehouse, put_id) was applied recently is not applied again: the
        indexes it got are returned (a warehouse re-sends commits whose reply it
        lost to a controller restart). `tags`: per-sample integer tags (one value for all, or one each).
        `token`: the writer's put token. A put re-sent to another warehouse after its first
        attempt's warehouse went away is committed again with the same token: its values are
        written again at the indexes the first attempt got where that warehouse lost them
        (answered, not lost), and where `away` (warehouses that do not answer now) holds them: a
        warehouse that went away between a commit and storing its values never stores them, and one
        that comes back from its data dir without them makes them unwritten; `stored` tells the
        re-sends whose values are all still held.
        """
        done = self.recall(warehouse, put_id)
        if done is not None:
            return done
        seen = self.tokens.get(token) if token else None
        if seen is not None and seen[0] == partition and partition in self.partitions:
            idx = self._rewrite(self.partitions[partition], seen[1], indexes_of(seen[2]), warehouse, nbytes, away)
            self.remember(warehouse, put_id, seen[2])
            return idx
        if tags:
            _check_tags(tags, new_count if indexes is None else len(indexes))
        idx = self._commit(partition, columns, warehouse, indexes, new_count, group_size, nbytes)
        if tags:
            self._set_tags(self.partitions[partition], idx, tags)
        kept = kept_as(idx, consecutive=indexes is None)  # (new samples are allocated consecutively)
        self.remember(warehouse, put_id, kept)
        if token:
            self.tokens.add(token, (partition, tuple(columns), kept))
        return idx

    def _unheld(self, part: _Partition, column: str, idx: np.ndarray, away: Collection[int] = ()) -> np.ndarray:
        """Which of `idx` (not deleted) have no live warehouse holding `column`: unwritten again, or on
        a warehouse that left the dock (or is in `away`)."""
        loc = part.loc[column][idx]
        out: np.ndarray = loc >= PENDING_WAREHOUSE
        gone = self.dead_warehouses.union(away) if away else self.dead_warehouses
        if gone:
            out |= np.isin(loc, np.fromiter(gone, dtype=np.uint16))
        out &= ~part.gone[idx]
        return out

    def stored(self, partition: str, token: int, away: Collection[int] = ()) -> np.ndarray | None:
        """The indexes a put with writer token `token` got, if every value it wrote is still held by a
        live warehouse not in `away` (or deleted since): a re-send of it is answered with them and
        stored nowhere."""
        seen = self.tokens.get(token) if token else None
        if seen is None or seen[0] != partition or partition not in self.partitions:
            return None
        part = self.partitions[partition]
        idx = indexes_of(seen[2])
        if any(self._unheld(part, c, idx, away).any() for c in seen[1]):
            return None
        return idx

    def _rewrite(self, part: _Partition, columns: Sequence[str], idx: np.ndarray, warehouse: int,
                 nbytes: int, away: Collection[int] = ()) -> np.ndarray:
        """A re-sent put whose values its first warehouse lost (or may never have stored: it is
        `away`): `warehouse` holds them now."""
        changed = []
        for c in columns:
            sel = idx[self._unheld(part, c, idx, away)]
            part.loc[c][sel] = warehouse
            part.ready[sel] |= np.uint64(1 << part.columns[c])
            changed.append(sel)
        sel = np.unique(np.concatenate(changed)) if changed else idx[:0]
        part.touch(sel)
        part.nbytes[warehouse] = part.nbytes.get(warehouse, 0) + nbytes
        for cons in part.consumers.values():  # (a consumer that met them lost may take them now)
            cons.state[sel[cons.state[sel] == LOST]] = FREE
            part.refresh(cons, sel)
        return idx

    def recall(self, warehouse: int, put_id: int) -> np.ndarray | None:
        """The indexes commit `put_id` of `warehouse` got, if it was applied recently (else None)."""
        recent = self.put_keys.get(warehouse) if put_id else None
        kept = recent.get(put_id) if recent is not None else None
        return None if kept is None else indexes_of(kept)

    def remember(self, warehouse: int, put_id: int, idx: np.ndarray | range) -> None:
        """A commit applied: re-sent with the same put_id, it gets these indexes back (`idx`: see kept_as)."""
        if put_id:
            self.remember_all(warehouse, ((put_id, idx),))

    def remember_all(self, warehouse: int, kept: Iterable[tuple[int, np.ndarray | range]]) -> None:
        """Commits of `warehouse` applied, in order: `remember` of each (put id, indexes), its put ids not 0."""
        keys = self.put_keys.get(warehouse)
        if keys is None:
            keys = self.put_keys[warehouse] = Recent(PUT_KEYS_KEPT, PUT_KEYS_CELLS)
        keys.add_all(kept)

    def _commit(self, partition: str, columns: Sequence[str], warehouse: int,
                indexes: Sequence[int] | np.ndarray | None, new_count: int, group_size: int,
                nbytes: int) -> np.ndarray:
        if not partition:
            raise DockValueError("partition must be a non-empty string")
        if not columns:
            raise DockValueError("a put needs at least one column")
        if len(set(columns)) != len(columns):
            raise DockValueError(f"duplicate column names in {list(columns)}")
        part = self.partitions.get(partition)
        if indexes is None:
            part = self._for_new(partition, new_count, group_size)
            bits = [part.bit(c) for c in columns]
            idx = self._allocate(part, new_count)
        else:
            part = existing(part, partition)
            idx = np.asarray(indexes, dtype=np.int64).reshape(-1)
            bits = unwritten(part, partition, columns, idx)
        record(part, columns, bits, idx, warehouse, nbytes)
        return idx

    def _for_new(self, partition: str, count: int, group_size: int) -> _Partition:
        """The partition new samples go to (made if need be), after checking they may."""
        if group_size < 1:
            raise DockValueError(f"group_size must be >= 1, got {group_size}")
        if count < 1 or count % group_size:
            raise DockValueError(
                f"a put of new samples needs a positive multiple of group_size={group_size} values, got {count}"
            )
        part = self.partitions.get(partition)
        total = self._sample_count()
        if total + count > self.max_samples:
            raise DockFull(f"the dock holds {total} samples and takes at most {self.max_samples} (--max-samples: the "
                           "controller keeps metadata for each); clear or delete finished samples first")
        if part is None:
            part = self._new_partition(partition, group_size)
        elif part.group_size != group_size:
            raise DockValueError(
                f"partition {partition!r} holds groups of {part.group_size}; new samples must use "
                f"group_size={part.group_size}, got {group_size}. Use another partition for another group size."
            )
        if part.sealed:
            raise DockValueError(f"partition {partition!r} is sealed: it takes no new samples (columns of its "
                                 "existing samples can still be written)")
        return part

    def _allocate(self, part: _Partition, count: int) -> np.ndarray:
        part.reserve(count)
        idx = np.arange(part.size, part.size + count, dtype=np.int64)
        part.size += count
        if self._samples is not None:
            self._samples += count
        return idx

    @property
    def max_samples(self) -> int:
        return self._max_samples

    @max_samples.setter
    def max_samples(self, n: int) -> None:
        self._max_samples = n
        self.cells.limit = CELLS_PER_SAMPLE * n

    def adopt(self, part: _Partition, *, counted: bool = False) -> None:
        """Hold a partition made elsewhere (restored, rebuilt: never refused), its memory counted here
        (`counted`: taken already)."""
        part.cells = self.cells
        if not counted:
            self.cells.used += part.cells_held()
        self.partitions[part.name] = part
        self._samples = None

    def _sample_count(self) -> int:
        if self._samples is None:
            self._samples = sum(p.size for p in self.partitions.values())
        return self._samples

    def _check_partitions(self) -> None:
        if len(self.partitions) >= limits.MAX_PARTITIONS:
            raise DockFull(f"the dock holds {len(self.partitions)} partitions, the most it takes; clear finished "
                           "ones (a partition is a step or a stream, not a sample)")

    def _new_partition(self, name: str, group_size: int) -> _Partition:
        """A partition made at a client's request (within the dock's bound on partitions)."""
        self._check_partitions()
        part = self.partitions[name] = _Partition(name, group_size, self.cells)
        return part

    # -- partitions and their samples -----------------------------------------------------
    def part(self, partition: str) -> _Partition:
        part = self.partitions.get(partition)
        if part is None:
            raise DockNotFound(f"partition {partition!r} does not exist (already cleared, or never written)")
        return part

    @staticmethod
    def _existing(part: _Partition, indexes: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indexes, dtype=np.int64).reshape(-1)
        bad = idx[(idx < 0) | (idx >= part.size)]
        if len(bad):
            raise DockNotFound(f"sample indexes {bad[:8].tolist()} do not exist in partition {part.name!r} "
                               f"(it holds indexes 0..{part.size - 1})")
        return idx

    def create_partition(self, partition: str, *, group_size: int = 1, retire: Sequence[str] = (),
                         max_staleness: int = -1, retire_stale: bool = False, max_pending: int = 0) -> None:
        """Make a partition (or set the options of an existing one with the same group size).
        retire: consumers that must all have confirmed a sample before it is deleted by itself.
        max_staleness: gets hand out only samples whose version is >= the trainer's version minus
        this (-1: no bound); retire_stale: set_version deletes the samples it makes too stale;
        max_pending: puts of new samples wait while this many are not yet taken (0: no bound)."""
        if max_staleness < -1 or max_pending < 0:
            raise DockValueError(f"max_staleness and max_pending are ints >= 0, got {max_staleness}, {max_pending}")
        if retire_stale and max_staleness < 0:
            raise DockValueError("retire_stale needs max_staleness: it deletes samples staler than that")
        if not partition:
            raise DockValueError("partition must be a non-empty string")
        if group_size < 1:
            raise DockValueError(f"group_size must be >= 1, got {group_size}")
        if any(not c for c in retire) or len(set(retire)) != len(retire):
            raise DockValueError(f"retire_when_consumed_by names distinct non-empty consumers, got {list(retire)}")
        part = self.partitions.get(partition)
        if part is None:
            part = self._new_partition(partition, group_size)
        elif part.group_size != group_size:
            raise DockValueError(f"partition {partition!r} already holds groups of {part.group_size}, "
                                 f"not {group_size}")
        part.retire = tuple(retire)
        part.max_staleness, part.retire_stale, part.max_pending = max_staleness, retire_stale, max_pending
        if part.retire:  # samples every named consumer already took go now
            self.retire(part, np.arange(part.size, dtype=np.int64))
        if part.retire_stale:
            self._retire_stale(part)

    def set_version(self, partition: str, version: int) -> int:
        """The trainer's current policy version; returns how many samples it made stale and
        deleted (retire_stale)."""
        if not 0 <= version <= INT64_MAX:
            raise DockValueError(f"a policy version is an int >= 0, got {version}")
        part = self.part(partition)
        part.version = version
        return self._retire_stale(part) if part.retire_stale else 0

    def _retire_stale(self, part: _Partition) -> int:
        n = self._delete(part, np.flatnonzero(part.stale_mask()))
        part.stale_retired += n
        return n

    def must_wait(self, partition: str, new_count: int) -> bool:
        """Whether a commit of new samples waits: the partition has max_pending and that many
        samples wait for its consumers."""
        part = self.partitions.get(partition)
        return bool(new_count and part is not None and part.max_pending and part.pending() >= part.max_pending)

    def reserve(self, partition: str, count: int, *, group_size: int = 1) -> np.ndarray:
        """New samples with no column written yet (a rollout fills them later, by index)."""
        return self._allocate(self._for_new(partition, count, group_size), count)

    def seal(self, partition: str) -> None:
        """No new samples from now on; gets that then cannot be met end (DockDrained)."""
        part = self.partitions.get(partition)
        if part is None:
            part = self._new_partition(partition, 1)
        part.sealed = True

    def set_tags(self, partition: str, indexes: Sequence[int] | np.ndarray, tags: Mapping[str, Sequence[int]]) -> None:
        part = self.part(partition)
        idx = self._existing(part, indexes)
        _check_tags(tags, len(idx))
        self._set_tags(part, idx, tags)

    @staticmethod
    def _set_tags(part: _Partition, idx: np.ndarray, tags: Mapping[str, Sequence[int]]) -> None:
        for name, values in tags.items():
            part.tag(name, create=True)[idx] = np.asarray(values, dtype=np.int64)
        part.touch(idx)

    def delete(self, partition: str, indexes: Sequence[int] | np.ndarray) -> int:
        """Delete samples: all their columns are freed (the frees wait in pending_frees) and no
        consumer gets them again. Returns how many were not deleted already."""
        part = self.part(partition)
        return self._delete(part, np.unique(self._existing(part, indexes)))

    def _delete(self, part: _Partition, idx: np.ndarray) -> int:
        idx = idx[~part.gone[idx]]
        if not len(idx):
            return 0
        frees = self.pending_frees.setdefault(part.name, {})
        for loc in [*part.loc.values(), *part.rloc.values()]:  # (homes and replicas)
            where = loc[idx]
            held = where < PENDING_WAREHOUSE
            for w in np.unique(where[held]).tolist():
                frees.setdefault(w, []).append(idx[where == w])
            loc[idx] = NO_WAREHOUSE
        if not frees:
            del self.pending_frees[part.name]
        part.gone[idx] = True
        part.ready[idx] = 0
        part.touch(idx)
        part.deleted += len(idx)
        for cons in part.consumers.values():
            part.refresh(cons, idx)
        return len(idx)

    def retire(self, part: _Partition, idx: np.ndarray) -> None:
        """Delete the samples of idx that every consumer named by the partition has taken."""
        conss = [part.consumers.get(c) for c in part.retire]
        present = [c for c in conss if c is not None]
        if len(present) < len(conss):
            return
        ok = np.ones(len(idx), dtype=bool)
        for cons in present:
            ok &= cons.state[idx] == TAKEN
        if ok.any():
            self._delete(part, idx[ok])

    def take_frees(self) -> dict[str, dict[int, np.ndarray]]:
        """The frees deletes left for warehouses: partition -> warehouse -> sample indexes."""
        out = {p: {w: np.unique(np.concatenate(a)) for w, a in ws.items()} for p, ws in self.pending_frees.items()}
        self.pending_frees = {}
        return out

    def forget(self, partition: str) -> _Partition:
        """Drop a partition (a clear): its samples and the frees pending for it."""
        part = self.partitions.pop(partition, None)
        if part is None:
            raise DockNotFound(f"partition {partition!r} does not exist (already cleared, or never written)")
        self._samples = None
        self.pending_frees.pop(partition, None)  # (a clear frees everything)
        self.cells.give(part.cells_held())
        return part

    def add(self, part: _Partition) -> None:
        """Add a partition made elsewhere (a checkpoint's), within the dock's bounds."""
        n = part.size
        self._check_partitions()
        if self._sample_count() + n > self.max_samples:
            raise DockFull(f"the checkpoint's {n} samples do not fit next to the dock's {self._sample_count()} "
                           f"(--max-samples {self.max_samples})")
        self.cells.take(part.cells_held(), f"the checkpoint's partition {part.name!r}")
        self.adopt(part, counted=True)

    def warehouse_bytes(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for part in self.partitions.values():
            for w, n in part.nbytes.items():
                out[w] = out.get(w, 0) + n
        return out


def existing(part: _Partition | None, partition: str) -> _Partition:
    """The partition a write of existing samples' columns goes to."""
    if part is None:
        raise DockNotFound(f"partition {partition!r} does not exist; put new samples first (without indexes)")
    return part


def unwritten(part: _Partition, partition: str, columns: Sequence[str], idx: np.ndarray) -> list[int]:
    """The bits of `columns` in `part`, once samples idx are checked to exist (not deleted), each once, with
    none of those columns written yet."""
    if len(idx) == 0:
        raise DockValueError("indexes is empty")
    bad = idx[(idx < 0) | (idx >= part.size)]
    if len(bad):
        raise DockNotFound(
            f"sample indexes {bad[:8].tolist()} do not exist in partition {partition!r} "
            f"(it holds indexes 0..{part.size - 1})"
        )
    if len(np.unique(idx)) != len(idx):
        raise DockValueError("indexes contain duplicates; each sample can appear once per put")
    if part.deleted:
        gone = idx[part.gone[idx]]
        if len(gone):
            raise DockNotFound(f"samples {gone[:8].tolist()} of partition {partition!r} were deleted")
    bits = [part.bit(c) for c in columns]
    for c, b in zip(columns, bits):
        dup = idx[(part.ready[idx] >> np.uint64(b)) & np.uint64(1) == 1]
        if len(dup):
            raise DockValueError(
                f"column {c!r} is already written for samples {dup[:8].tolist()} of partition "
                f"{partition!r}; a sample's column is written once"
            )
    return bits


def record(part: _Partition, columns: Sequence[str], bits: list[int], idx: np.ndarray, warehouse: int,
            nbytes: int) -> None:
    """`warehouse` holds `columns` (their `bits`) of samples idx, `nbytes` more: each consumer's view of them
    is refreshed."""
    newbits = part.write(columns, bits, idx, warehouse)
    part.nbytes[warehouse] = part.nbytes.get(warehouse, 0) + nbytes
    for cons in part.consumers.values():
        subs = [s for s in cons.subs.values() if s.mask & newbits]
        if subs:
            part.refresh(cons, idx, subs)
