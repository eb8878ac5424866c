"""Warehouse: the tensors of the samples written on this node, by batch. Pure logic, no I/O.

Each put's column arrives as runs (`dockd.v1.Run`: values back to back in
one buffer). A run is kept as one `_Batch`: a zero-copy slice of the Arrow
buffer (or shared-memory segment) the put's body was received into, the
run's dtype and shape, and, for ragged runs, one end offset per row (uint32
when the run is under 4 GiB). A sample index maps to its batch through one
flat int32 array per (partition, column); its row is its index minus the
batch's first index when the batch's samples have consecutive indexes (a put
of new samples always), else a per-batch lookup. So a stored value costs 4
bytes of bookkeeping (8 when ragged) and no Python object, and a get of
consecutive samples of one put is one slice per column, whatever their
number.

Memory is counted in bytes per put body: a put first `reserve`s its size
(backpressure happens there), then `store` turns the reservation into usage.
The bookkeeping of a put counts against the capacity too (`meta`: `META_PUT`
per put and `META_VALUE` per stored value, about what it costs, measured), so
that puts of empty values cannot grow a warehouse past its capacity while it
reports nothing in use.

Deleting samples (`free_samples`) releases a put's body once every sample it
holds is deleted, and compacts a body of 64 KiB or more once half of its bytes
are deleted (its live values copied into memory of their size); `freed` and
`reclaimable` count what deletes gave back and what they still hold.

The device tier (`device_capacity` > 0) keeps runs a writer put with
`device="keep"` in device memory of the warehouse's own (a flat uint8
tensor per put's device buffer, on the writer's device): the same batches,
with `device` holding the bytes instead of `data`. Its bytes are counted
apart from host memory (`device_reserve`, `device_used`); a put whose device
bytes do not fit is stored in host memory instead (the daemon spills it).

The spill tier (`tier`, `dockd.warehouse.spill`): with one, `lru` orders the
in-memory puts from least to most recently stored or read; a put that finds no room
(`reserve`) has the tier spill puts from its front to files (`mark_spilled`: their
batches keep their rows, their bytes leave memory, `spilled` counts them), and a fetch
of a spilled put has the tier restore it (`mark_restored`) or read it for that reply.

Checkpoint files of a warehouse's partitions are written and read by
`dockd.warehouse.dump`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockFull, DockNotFound, DockValueError
from dockd.warehouse.layout import (
    SMALL_RUN,
    Indexes,
    Spilled,
    _Batch,
    _Body,
    _Column,
    _first_of_range,
    _idx,
    _Part,
    compacted,
    inventory,
)
from dockd.warehouse.putfile import Room
from dockd.warehouse.tiers import Keeper, Tier

if TYPE_CHECKING:
    import torch

SMALL_READ = 8  # reads of up to this many samples per column take the scalar path (Warehouse.fetch)
COMPACT_MIN = 64 << 10  # bytes of a put's body from which deletes compact it (smaller ones wait for all)
META_PUT = 1024   # bytes of bookkeeping a put costs (objects per put and run; ~900 measured for one value)
META_VALUE = 16   # ... and each value it stores (index maps, ragged ends: 6-17 measured)


class Warehouse:
    def __init__(self, capacity: int, device_capacity: int = 0) -> None:
        if capacity <= 0:
            raise DockValueError(f"warehouse capacity must be > 0 bytes, got {capacity}")
        if device_capacity < 0:
            raise DockValueError(f"device capacity must be >= 0 bytes (0: no device tier), got {device_capacity}")
        self.capacity = capacity
        self.used = 0
        self.reserved = 0
        self.meta = 0  # bytes of bookkeeping of what is stored (see META_PUT)
        self.lent = 0  # bytes of segments whose data is gone but that readers still map (see Segments.release)
        self.freed = 0  # bytes deletes gave back (whole puts, and compactions)
        self.reclaimable = 0  # bytes of deleted values still held: their put is mostly alive (or small)
        self.device_capacity = device_capacity
        self.device_used = 0
        self.device_reserved = 0
        self.parts: dict[str, _Part] = {}
        self.keeper: Keeper | None = None  # the data dir (--data-dir): every store is written there first
        self.tier: Tier | None = None  # the spill tier (--spill-dir): what does not fit goes to files
        self.lru: OrderedDict[int, tuple[str, _Body]] = OrderedDict()  # with a tier: in-memory puts, least recent first
        self.spilled = 0  # bytes of stored puts spilled (out of memory; not in `used`)

    # -- capacity -------------------------------------------------------------------------
    def check_fits(self, nbytes: int) -> None:
        if nbytes > self.capacity:
            raise DockFull(
                f"a put of {nbytes} bytes can never fit in this warehouse (capacity {self.capacity} bytes); "
                "split it into smaller puts or start the warehouse with a larger --capacity"
            )

    def reserve(self, nbytes: int, spill: bool = True, queued: bool = False) -> bool:
        """Reserve room for `nbytes` (with a spill tier and `spill`: spilling puts to make it; for a put
        `queued` for room, big ones in the background: False until they have left memory)."""
        if self.held() + nbytes > self.capacity:
            if not spill or self.tier is None:
                return False
            self.tier.make_room(nbytes, background=queued)
            if self.held() + nbytes > self.capacity:
                return False
        self.reserved += nbytes
        return True

    def held(self) -> int:
        """Bytes of memory counted against the capacity: stored, their bookkeeping, in flight, and freed data
        that readers still map."""
        return self.used + self.meta + self.reserved + self.lent

    def unreserve(self, nbytes: int) -> None:
        self.reserved -= nbytes
        assert self.reserved >= 0

    def device_reserve(self, nbytes: int) -> bool:
        """Room in the device tier for a put's device bytes (no waiting: what does not fit is spilled)."""
        if self.device_used + self.device_reserved + nbytes > self.device_capacity:
            return False
        self.device_reserved += nbytes
        return True

    def device_unreserve(self, nbytes: int) -> None:
        self.device_reserved -= nbytes
        assert self.device_reserved >= 0

    # -- puts ------------------------------------------------------------------------------
    def check_absent(self, partition: str, indexes: Indexes, columns: Iterable[str],
                     first: int | None = None) -> None:
        """Raise if any of `columns` is stored for any of `indexes` (`first`: they are known to be
        consecutive from this one, as a put of new samples' are)."""
        part = self.parts.get(partition)
        if part is None:
            return
        if len(indexes) <= SMALL_RUN:  # (a few samples: scalar looks first, arrays only to name a duplicate)
            few = [int(i) for i in indexes]
            columns = [c for c in columns if c in part.columns and part.columns[c].any_present(few)]
            if not columns:
                return
        idx = _idx(indexes)
        for c in columns:
            col = part.columns.get(c)
            if col is not None:
                if first is not None:  # (a slice: no fancy indexing)
                    taken = col.batch_of[first : first + len(idx)] >= 0
                    dup = idx[: len(taken)][taken] if taken.any() else idx[:0]
                else:
                    dup = idx[col.present(idx)]
                if len(dup):
                    raise DockValueError(
                        f"column {c!r} is already written for samples {dup[:8].tolist()} of partition {partition!r}; "
                        "a sample's column is written once"
                    )

    def store(self, partition: str, indexes: Indexes, columns: Sequence[pb.ColumnData], body: pa.Buffer | None,
              nbytes: int, segment: object = None, group_size: int = 0,
              device: Sequence[torch.Tensor] | None = None, token: int = 0, room: Room | None = None) -> None:
        """Keep each run as a batch (a slice of body, or of `device[k - 1]` for a run in device
        buffer k: the warehouse's own copies, whose bytes `device_reserve` reserved) and file its
        rows under the indexes; uses the reservations. With a keeper (a data dir) the put is
        written there first (`token`: the writer's, kept with it; into `room`, the disk room taken for
        it before its commit, if any); if that fails nothing is stored, the reservation is given back
        and the error raised."""
        device = device or ()
        device_nbytes = sum(int(t.numel()) for t in device)
        idx = _idx(indexes)
        few = idx.tolist() if len(idx) <= SMALL_RUN else None  # (a few samples: filed with scalar writes)
        first = _first_of_range(idx) if few is None else None  # (consecutive indexes: filed by slices)
        self.check_absent(partition, idx, [c.name for c in columns[:]], first)
        file = None
        if self.keeper is not None:
            try:
                file = self.keeper.stored(partition, idx, columns, body, nbytes, group_size, token, room)
            except Exception:
                self.reserved -= nbytes
                raise
        part = self.parts.setdefault(partition, _Part())
        if group_size:
            part.group_size = group_size
        if segment is not None:
            part.segments.append(segment)
        top = (max(few, default=-1) if few is not None else first + len(idx) - 1 if first is not None
               else int(idx.max()) if len(idx) else -1) + 1
        owner = _Body(nbytes, segment, len(idx), columns[0].name if columns else "", device_nbytes)
        owner.file = file
        owner.file_layout = file is not None
        owner.buf = body
        for c in columns[:]:  # ([:]: see dockd.net.wire)
            col = part.columns.get(c.name)
            if col is None:
                col = part.columns[c.name] = _Column()
            col.grow(top)
            k = 0
            for run in c.runs[:]:
                dev = None
                if run.device_buffer:
                    data, dev = None, device[run.device_buffer - 1][run.offset : run.offset + run.nbytes]
                elif run.nbytes:
                    assert body is not None  # (a put with bytes on the host has a body)
                    data = body.slice(run.offset, run.nbytes)
                else:
                    data = pa.py_buffer(b"")
                bid = len(col.batches)
                start = None
                if few is not None:
                    rows: np.ndarray | list[int] = few[k : k + run.count]
                    for r in rows:
                        col.batch_of[r] = bid
                elif first is not None:
                    start = first + k
                    rows = idx[k : k + run.count]
                    col.batch_of[start : start + run.count] = bid
                else:
                    rows = idx[k : k + run.count]
                    col.batch_of[rows] = bid
                owner.batches.append((c.name, len(col.batches)))  # (names, not objects: no reference cycle)
                col.batches.append(_Batch(run, data, None if dev is not None else segment, rows, owner, dev, start))
                k += run.count
        self.reserved -= nbytes
        self.used += nbytes
        part.nbytes += nbytes
        owner.meta = META_PUT + META_VALUE * len(idx) * len(columns)
        self.meta += owner.meta
        part.meta += owner.meta
        self.device_reserved -= device_nbytes
        self.device_used += device_nbytes
        part.device_nbytes += device_nbytes
        if self.tier is not None:
            part.bodies[id(owner)] = owner
            if body is not None and nbytes and not device_nbytes:
                self.lru[id(owner)] = (partition, owner)

    # -- the spill tier ----------------------------------------------------------------------------
    @property
    def spill_figures(self) -> tuple[int, int] | None:
        """With a spill tier: (bytes in spill files, --spill-capacity); else None (dockd.node.metrics)."""
        return (self.tier.bytes, self.tier.capacity) if self.tier is not None else None

    def spill_candidates(self) -> Iterator[tuple[str, _Body]]:
        """In-memory puts the tier may spill, least recently stored or read first: (partition, body)."""
        for partition, body in list(self.lru.values()):  # (a snapshot: the caller spills as it goes)
            if body.buf is not None and body.spill is None and not body.device_nbytes:
                yield partition, body

    def mark_spilled(self, partition: str, body: _Body, where: Spilled) -> object:
        """`body` is now in `where`: its memory goes (returns its segment, for the pool)."""
        base = body.buf
        assert base is not None
        part = self.parts[partition]
        for name, bid in body.batches:
            b = part.columns[name].batches[bid]
            if b is None or b.data is None or not b.data.size:
                continue
            b.at = (b.data.address - base.address, b.data.size)
            b.data, b.segment = None, None
        seg = self._unlink_segment(part, body)
        body.segment, body.buf, body.spill = None, None, where
        self.lru.pop(id(body), None)
        part.nbytes -= body.nbytes
        self.used -= body.nbytes
        part.spilled += body.nbytes
        self.spilled += body.nbytes
        return seg

    def mark_restored(self, partition: str, part: _Part, body: _Body, buf: pa.Buffer, segment: object) -> None:
        """A spilled put is in memory again, in `buf` (of `segment`, if one), whose room was reserved."""
        for name, bid in body.batches:
            b = part.columns[name].batches[bid]
            if b is None or b.data is not None or b.device is not None:
                continue
            b.data, b.segment = buf.slice(b.at[0], b.at[1]), segment
        body.buf, body.segment, body.spill = buf, segment, None
        if segment is not None:
            part.segments.append(segment)
        self.lru[id(body)] = (partition, body)
        self.reserved -= body.nbytes
        self.used += body.nbytes
        part.nbytes += body.nbytes
        part.spilled -= body.nbytes
        self.spilled -= body.nbytes

    # -- reads and frees -----------------------------------------------------------------------
    def fetch(self, partition: str, wanted: Sequence[tuple[str, Indexes]]) -> list[tuple[str, list[tuple]]]:
        """For each (column, indexes): the stored slices holding them, in order, as (batch, row, row_end)."""
        part = self.parts.get(partition)
        if part is None:
            raise DockNotFound(f"partition {partition!r} is not in this warehouse (cleared?)")
        out = []
        seen: object = None  # the indexes last converted (a get's columns share one list), as idx and its first
        for name, indexes in wanted:
            col = part.columns.get(name)
            if col is not None and isinstance(indexes, list) and len(indexes) <= SMALL_READ:
                small = col.slices_small(indexes)
                if small is not None:
                    out.append((name, small))
                    continue
            if indexes is not seen:
                seen, idx = indexes, _idx(indexes)
                first = _first_of_range(idx)  # (consecutive indexes: one batch per column, mostly)
            if first is not None and col is not None:
                one = col.range_slices(first, len(idx))
                if one is not None:
                    out.append((name, one))
                    continue
            out.append((name, _slices(col, name, idx, partition)))
        if self.tier is not None:
            return self.tier.resolve(partition, part, out)
        return out

    def has(self, partition: str, wanted: Sequence[tuple[str, Indexes]]) -> bool:
        part = self.parts.get(partition)
        if part is None:
            return False
        return all(c in part.columns and bool(part.columns[c].present(_idx(idx)).all()) for c, idx in wanted)

    def free_samples(self, partition: str, indexes: Indexes) -> tuple[int, list]:
        """Delete samples (all their columns). Returns the bytes released and the segments no
        longer used. A put's body goes once all of its samples are deleted; before that, once
        deleted values make up half of a body of COMPACT_MIN bytes or more, its live values are
        copied into a body of their own size and the old one is released (compaction: each byte
        is copied a bounded number of times, as each copy at least halves the body)."""
        part = self.parts.get(partition)
        if part is None:
            return 0, []
        idx = np.unique(_idx(indexes))
        touched: dict[int, _Body] = {}
        for name, col in part.columns.items():
            here = idx[col.present(idx)]
            if not len(here):
                continue
            bids = col.batch_of[here]
            col.batch_of[here] = -1
            for bid in np.unique(bids).tolist():
                b = col.batches[bid]
                if b is None or b.body is None:
                    continue
                rows = b.rows(here[bids == bid])
                offs = b.offsets()
                if b.device is None:  # (device-tier bytes go when their whole put does)
                    dead = int((offs[rows + 1] - offs[rows]).sum())
                    b.body.dead += dead
                    self.reclaimable += dead
                    part.dead += dead
                if b.body.first_column == name:
                    b.body.live -= len(rows)
                touched[id(b.body)] = b.body
        if self.keeper is not None and touched:
            self.keeper.deleted(partition, idx)
        freed, segs = 0, []
        for body in touched.values():
            if body.live <= 0:
                n, seg = self._drop_body(part, body)
            elif body.device_nbytes == 0 and body.spill is None and body.nbytes >= COMPACT_MIN and \
                    2 * body.dead >= body.nbytes - 64 * len(body.batches):  # (runs are padded to 64 bytes)
                n, seg = self._compact(partition, part, body)
            else:
                continue
            freed += n
            if seg is not None:
                segs.append(seg)
        return freed, segs

    def _drop_body(self, part: _Part, body: _Body) -> tuple[int, object]:
        for name, bid in body.batches:
            part.columns[name].batches[bid] = None
        part.meta -= body.meta
        self.meta -= body.meta
        part.device_nbytes -= body.device_nbytes
        self.device_used -= body.device_nbytes
        self.reclaimable -= body.dead
        part.dead -= body.dead
        part.bodies.pop(id(body), None)
        self.lru.pop(id(body), None)
        if body.spill is not None:  # (its bytes are in a file, not in memory)
            part.spilled -= body.nbytes
            self.spilled -= body.nbytes
            self.freed += body.nbytes
            assert self.tier is not None
            self.tier.discard(body.spill)
            body.spill = None
        else:
            self._release(part, body.nbytes)
        if body.file is not None and self.keeper is not None:
            self.keeper.remove(body.file)
        return body.nbytes, self._unlink_segment(part, body)

    def _compact(self, partition: str, part: _Part, body: _Body) -> tuple[int, object]:
        """Copy a body's live values into a new body of their size; (bytes freed, old segment)."""
        owner = compacted(part, body)
        if self.tier is not None:
            part.bodies.pop(id(body), None)
            self.lru.pop(id(body), None)
            part.bodies[id(owner)] = owner
            self.lru[id(owner)] = (partition, owner)
        freed = body.nbytes - owner.nbytes
        self.reclaimable -= body.dead
        part.dead -= body.dead
        self._release(part, freed)
        return freed, self._unlink_segment(part, body)

    def _release(self, part: _Part, nbytes: int) -> None:
        part.nbytes -= nbytes
        self.used -= nbytes
        self.freed += nbytes

    @staticmethod
    def _unlink_segment(part: _Part, body: _Body) -> object:
        if body.segment is not None and body.segment in part.segments:
            part.segments.remove(body.segment)
            return body.segment
        return None

    def measure(self, partition: str, column: str, indexes: Indexes) -> np.ndarray:
        """Per sample: the column's value when it holds numbers (one per sample), else its size
        (elements of the tensor; a ragged tensor's own length times its row size)."""
        (_, slices), = self.fetch(partition, [(column, _idx(indexes))])
        out = [b.measure(column, r0, r1) for b, r0, r1 in slices]
        return np.concatenate(out) if out else np.zeros(0)

    def free(self, partition: str) -> int:
        part = self.parts.pop(partition, None)
        if self.keeper is not None:
            self.keeper.cleared(partition)
        if part is None:
            return 0
        for key, body in part.bodies.items():
            self.lru.pop(key, None)
            if body.spill is not None:
                assert self.tier is not None
                self.tier.discard(body.spill)
                body.spill = None
        self.used -= part.nbytes
        self.spilled -= part.spilled
        self.meta -= part.meta
        self.reclaimable -= part.dead
        self.device_used -= part.device_nbytes
        return part.nbytes + part.spilled

    def segments_of(self, partition: str) -> list:
        """The shared-memory segments a partition's data lives in."""
        part = self.parts.get(partition)
        return list(part.segments) if part is not None else []

    def inventory(self, uncommitted: Sequence[pb.CommitRequest] = ()) -> list[pb.InventoryPartition]:
        """What this warehouse holds, as sorted index runs per column, leaving out stored values
        whose commit is still pending (`uncommitted`): those are re-committed separately."""
        return inventory(self.parts, uncommitted)

    def stats(self) -> dict:
        return {
            "capacity": self.capacity,
            "used": self.used,
            "metadata": self.meta,
            "freed": self.freed,
            "reclaimable": self.reclaimable,
            "reserved": self.reserved,
            "lent": self.lent,
            "device_capacity": self.device_capacity,
            "device_used": self.device_used,
            "spilled": self.spilled,
            "partitions": {name: p.nbytes + p.spilled for name, p in self.parts.items()},
        }


def _slices(col: _Column | None, name: str, idx: np.ndarray, partition: str) -> list:
    """The general path of `Warehouse.fetch` for one column: the slices holding samples `idx` (col None: idx
    is empty, or the column is not here)."""
    ok = col.present(idx) if col is not None else np.zeros(len(idx), dtype=bool)
    if not ok.all():
        raise DockNotFound(
            f"column {name!r} of samples {idx[~ok][:8].tolist()} of partition {partition!r} is not in this warehouse"
        )
    return col.slices(idx) if col is not None else []
