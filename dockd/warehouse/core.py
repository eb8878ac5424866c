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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa

from dockd._proto import dockd_pb2 as pb
from dockd.codec import ITEMSIZE
from dockd.errors import DockFull, DockNotFound, DockValueError


class _Batch:
    """One stored run: values back to back in `data`, for the samples `first`.. (consecutive
    indexes) or, when `order` is set, for the indexes `order` sorts into `keys`."""

    __slots__ = ("kind", "dtype", "shape", "unit", "ends", "lengths", "data", "segment", "count", "first", "keys",
                 "order")

    def __init__(self, run: pb.Run, data: pa.Buffer, segment: object, rows: np.ndarray) -> None:
        self.kind = run.kind
        self.dtype = run.dtype
        self.shape = tuple(run.shape)
        self.count = run.count
        self.data = data
        self.segment = segment
        self.lengths = self.ends = None
        if run.kind == pb.MSGPACK:
            self.unit = 1
        elif self.shape and self.shape[0] == -1:
            self.unit = math.prod(self.shape[1:]) * ITEMSIZE[run.dtype]  # bytes per unit of the first dimension
        else:
            self.unit = math.prod(self.shape) * ITEMSIZE[run.dtype]  # bytes per value
        if run.kind == pb.MSGPACK or (self.shape and self.shape[0] == -1):
            small = run.nbytes < (1 << 32)
            self.lengths = np.asarray(run.lengths, dtype=np.uint32 if small else np.uint64)
            self.ends = np.cumsum(self.lengths, dtype=np.uint64)
            if self.unit != 1:
                self.ends *= np.uint64(self.unit)
            if small:
                self.ends = self.ends.astype(np.uint32)
        self.first = int(rows[0]) if len(rows) else 0
        if not len(rows) or (int(rows[-1]) - self.first == len(rows) - 1
                             and (len(rows) < 3 or bool((rows[1:] - rows[:-1] == 1).all()))):
            self.keys = self.order = None
        else:  # indexes in any order (a put of existing samples): look rows up
            self.order = np.argsort(rows, kind="stable").astype(np.int32)
            self.keys = rows[self.order]

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """Rows of samples `idx` (all stored in this batch)."""
        if self.order is None:
            return idx - self.first
        return self.order[np.searchsorted(self.keys, idx)].astype(np.int64)

    def span(self, r0: int, r1: int) -> tuple[int, int]:
        """Byte range of rows [r0, r1) within the batch."""
        if self.ends is None:
            return r0 * self.unit, r1 * self.unit
        return (int(self.ends[r0 - 1]) if r0 else 0), int(self.ends[r1 - 1])

    def run(self, r0: int, r1: int) -> pb.Run:
        """Rows [r0, r1) as a run (offset left to the caller)."""
        lo, hi = self.span(r0, r1)
        out = pb.Run(kind=self.kind, count=r1 - r0, dtype=self.dtype, shape=self.shape, nbytes=hi - lo)
        if self.lengths is not None:
            out.lengths.extend(self.lengths[r0:r1].tolist())
        return out


class _Column:
    """Where each sample's value of one column is: its batch id by sample index (-1: none)."""

    __slots__ = ("batch_of", "batches")

    def __init__(self) -> None:
        self.batch_of = np.full(0, -1, dtype=np.int32)
        self.batches: list[_Batch | None] = []

    def grow(self, size: int) -> None:
        if size <= len(self.batch_of):
            return
        cap = max(size, len(self.batch_of) + len(self.batch_of) // 2, 1024)
        b = np.full(cap, -1, dtype=np.int32)
        b[: len(self.batch_of)] = self.batch_of
        self.batch_of = b

    def present(self, idx: np.ndarray) -> np.ndarray:
        ok = idx < len(self.batch_of)
        ok[ok] = self.batch_of[idx[ok]] >= 0
        return ok


class _Part:
    __slots__ = ("columns", "nbytes", "group_size", "segments")

    def __init__(self) -> None:
        self.columns: dict[str, _Column] = {}
        self.nbytes = 0
        self.group_size = 0  # known once a put of new samples landed here
        self.segments: list = []  # shared-memory segments its puts landed in


def _idx(indexes) -> np.ndarray:
    return np.asarray(indexes, dtype=np.int64).reshape(-1)


class Warehouse:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise DockValueError(f"warehouse capacity must be > 0 bytes, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self.reserved = 0
        self.parts: dict[str, _Part] = {}

    # -- capacity -------------------------------------------------------------------------
    def check_fits(self, nbytes: int) -> None:
        if nbytes > self.capacity:
            raise DockFull(
                f"a put of {nbytes} bytes can never fit in this warehouse (capacity {self.capacity} bytes); "
                "split it into smaller puts or start the warehouse with a larger --capacity"
            )

    def reserve(self, nbytes: int) -> bool:
        if self.used + self.reserved + nbytes > self.capacity:
            return False
        self.reserved += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        self.reserved -= nbytes
        assert self.reserved >= 0

    # -- puts ------------------------------------------------------------------------------
    @staticmethod
    def validate_put(req: pb.PutRequest, body_size: int | None = None) -> int:
        """Check a put's header (and its runs against the body, when its size is known); the
        number of samples. The one place a put is validated."""
        from dockd.codec import check_columns

        if not req.partition:
            raise DockValueError("partition must be a non-empty string")
        if body_size is None:  # before the body is in: only the shape of the request
            if not req.columns:
                raise DockValueError("a put needs at least one column")
            counts = {c.name: sum(r.count for r in c.runs) for c in req.columns}
            n = next(iter(counts.values()))
            if n == 0 or any(v != n for v in counts.values()):
                raise DockValueError(f"every column needs the same positive number of values, got {counts}")
        else:
            n = check_columns(req.columns, body_size)
        if req.indexes:
            if len(req.indexes) != n:
                raise DockValueError(f"{len(req.indexes)} indexes given for {n} values per column")
            if req.new_count:
                raise DockValueError("a put gives either indexes (existing samples) or new samples, not both")
        else:
            gs = req.group_size or 1
            if req.new_count != n:
                raise DockValueError(f"new_count={req.new_count} does not match {n} values per column")
            if n % gs:
                raise DockValueError(f"{n} new samples is not a multiple of group_size={gs}")
        return n

    def check_absent(self, partition: str, indexes: Sequence[int], columns: Iterable[str]) -> None:
        part = self.parts.get(partition)
        if part is None:
            return
        idx = _idx(indexes)
        for c in columns:
            col = part.columns.get(c)
            if col is not None:
                dup = idx[col.present(idx)]
                if len(dup):
                    raise DockValueError(
                        f"column {c!r} is already written for samples {dup[:8].tolist()} of partition {partition!r}; "
                        "a sample's column is written once"
                    )

    def store(self, partition: str, indexes: Sequence[int], columns: Sequence[pb.ColumnData], body: pa.Buffer | None,
              nbytes: int, segment: object = None, group_size: int = 0) -> None:
        """Keep each run as a batch (a slice of body) and file its rows under the indexes; uses the reservation."""
        self.check_absent(partition, indexes, (c.name for c in columns))
        part = self.parts.setdefault(partition, _Part())
        if group_size:
            part.group_size = group_size
        if segment is not None:
            part.segments.append(segment)
        idx = _idx(indexes)
        top = int(idx.max()) + 1 if len(idx) else 0
        for c in columns:
            col = part.columns.get(c.name)
            if col is None:
                col = part.columns[c.name] = _Column()
            col.grow(top)
            k = 0
            for run in c.runs:
                data = body.slice(run.offset, run.nbytes) if run.nbytes else pa.py_buffer(b"")
                rows = idx[k : k + run.count]
                col.batch_of[rows] = len(col.batches)
                col.batches.append(_Batch(run, data, segment, rows))
                k += run.count
        self.reserved -= nbytes
        self.used += nbytes
        part.nbytes += nbytes

    def unstore(self, partition: str, indexes: Sequence[int], columns: Iterable[str], nbytes: int) -> list:
        """Undo a store whose commit the controller refused; the segments it no longer uses."""
        part = self.parts.get(partition)
        if part is None:
            return []
        idx = _idx(indexes)
        gone = []
        for c in columns:
            col = part.columns.get(c)
            if col is None:
                continue
            here = idx[col.present(idx)]
            for b in np.unique(col.batch_of[here]).tolist():
                seg = col.batches[b].segment
                if seg is not None and seg not in gone:
                    gone.append(seg)
                col.batches[b] = None  # its rows are all among these samples: they came in one put
            col.batch_of[here] = -1
        part.segments = [s for s in part.segments if s not in gone]
        part.nbytes -= nbytes
        self.used -= nbytes
        return gone

    # -- reads and frees -----------------------------------------------------------------------
    def fetch(self, partition: str, wanted: Sequence[tuple[str, Sequence[int]]]) -> list[tuple[str, list[tuple]]]:
        """For each (column, indexes): the stored slices holding them, in order, as (batch, row, row_end)."""
        part = self.parts.get(partition)
        if part is None:
            raise DockNotFound(f"partition {partition!r} is not in this warehouse (cleared?)")
        out = []
        for name, indexes in wanted:
            idx = _idx(indexes)
            col = part.columns.get(name)
            ok = col.present(idx) if col is not None else np.zeros(len(idx), dtype=bool)
            if not ok.all():
                raise DockNotFound(
                    f"column {name!r} of samples {idx[~ok][:8].tolist()} of partition {partition!r} is not in this warehouse"
                )
            out.append((name, self._slices(col, idx)))
        return out

    @staticmethod
    def _slices(col: _Column, idx: np.ndarray) -> list[tuple]:
        """Consecutive rows of one batch become one slice."""
        if not len(idx):
            return []
        b = col.batch_of[idx]
        if b[0] == b[-1] and (b == b[0]).all():  # the common case: all from one put
            r = col.batches[int(b[0])].rows(idx)
        else:
            bs = np.unique(b)
            r = np.empty(len(idx), dtype=np.int64)
            for bid in bs.tolist():
                sel = b == bid
                r[sel] = col.batches[bid].rows(idx[sel])
        breaks = np.flatnonzero((b[1:] != b[:-1]) | (r[1:] != r[:-1] + 1)) + 1
        starts = np.concatenate(([0], breaks)).tolist()
        ends = np.concatenate((breaks, [len(idx)])).tolist()
        bl, rl = b.tolist(), r.tolist()
        return [(col.batches[bl[s]], rl[s], rl[e - 1] + 1) for s, e in zip(starts, ends)]

    def has(self, partition: str, wanted: Sequence[tuple[str, Sequence[int]]]) -> bool:
        part = self.parts.get(partition)
        if part is None:
            return False
        return all(c in part.columns and bool(part.columns[c].present(_idx(idx)).all()) for c, idx in wanted)

    def free(self, partition: str) -> int:
        part = self.parts.pop(partition, None)
        if part is None:
            return 0
        self.used -= part.nbytes
        return part.nbytes

    def segments_of(self, partition: str) -> list:
        """The shared-memory segments a partition's data lives in."""
        part = self.parts.get(partition)
        return list(part.segments) if part is not None else []

    def free_all(self) -> int:
        return sum(self.free(p) for p in list(self.parts))

    def inventory(self, uncommitted: Sequence[pb.CommitRequest] = ()) -> list[pb.InventoryPartition]:
        """What this warehouse holds, as sorted index runs per column, leaving out stored values
        whose commit is still pending (`uncommitted`): those are re-committed separately."""
        skip: dict[tuple[str, str], np.ndarray] = {}
        for c in uncommitted:
            for name in c.columns:
                prev = skip.get((c.partition, name))
                new = _idx(c.indexes)
                skip[(c.partition, name)] = new if prev is None else np.concatenate((prev, new))
        out = []
        for name, part in self.parts.items():
            inv = pb.InventoryPartition(name=name, group_size=part.group_size, nbytes=part.nbytes)
            for col_name, col in part.columns.items():
                idx = np.flatnonzero(col.batch_of >= 0)
                drop = skip.get((name, col_name))
                if drop is not None:
                    idx = idx[~np.isin(idx, drop)]
                inv.columns.add(name=col_name, runs=_runs(idx))
            out.append(inv)
        return out

    def stats(self) -> dict:
        return {
            "capacity": self.capacity,
            "used": self.used,
            "reserved": self.reserved,
            "partitions": {name: p.nbytes for name, p in self.parts.items()},
        }


def _runs(idx: np.ndarray) -> list[int]:
    """Sorted indexes as [start, stop) pairs, flattened."""
    if not len(idx):
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate([idx[:1], idx[breaks]])
    stops = np.concatenate([idx[breaks - 1] + 1, idx[-1:] + 1])
    return np.stack([starts, stops], axis=1).ravel().tolist()
