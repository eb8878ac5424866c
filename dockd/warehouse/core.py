"""Warehouse: the tensors of the samples written on this node. Pure logic, no I/O.

Values are stored as zero-copy slices of the Arrow buffer each put's body was
received into, so a put costs no copy beyond the socket read, and freeing a
partition drops its buffers. Memory is counted in bytes per put body: a put
first `reserve`s its size (backpressure happens there), then `store` turns the
reservation into usage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockFull, DockNotFound, DockValueError


@dataclasses.dataclass(slots=True)
class Stored:
    """One sample's value in one column."""

    meta: pb.Value  # kind, dtype, shape, nbytes; offset: within the put's body (= within `segment`)
    data: pa.Buffer
    segment: object = None  # the shm.Segment the body lives in, when it is shared memory


class _Part:
    __slots__ = ("columns", "nbytes", "group_size")

    def __init__(self) -> None:
        self.columns: dict[str, dict[int, Stored]] = {}
        self.nbytes = 0
        self.group_size = 0  # known once a put of new samples landed here


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
    def validate_put(req: pb.PutRequest) -> int:
        """Check a put's header; returns the number of samples."""
        if not req.partition:
            raise DockValueError("partition must be a non-empty string")
        if not req.columns:
            raise DockValueError("a put needs at least one column")
        names = [c.name for c in req.columns]
        if len(set(names)) != len(names) or not all(names):
            raise DockValueError(f"column names must be non-empty and distinct, got {names}")
        counts = {c.name: len(c.values) for c in req.columns}
        n = len(req.columns[0].values)
        if n == 0 or any(v != n for v in counts.values()):
            raise DockValueError(f"every column needs the same positive number of values, got {counts}")
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
        for c in columns:
            col = part.columns.get(c)
            if col:
                dup = [i for i in indexes if i in col]
                if dup:
                    raise DockValueError(
                        f"column {c!r} is already written for samples {dup[:8]} of partition {partition!r}; "
                        "a sample's column is written once"
                    )

    def store(self, partition: str, indexes: Sequence[int], columns: Sequence[pb.ColumnData], body: pa.Buffer | None,
              nbytes: int, segment: object = None, group_size: int = 0) -> None:
        """Keep the values (slices of body) under (partition, column, index); uses the reservation."""
        self.check_absent(partition, indexes, (c.name for c in columns))
        part = self.parts.setdefault(partition, _Part())
        if group_size:
            part.group_size = group_size
        for c in columns:
            col = part.columns.setdefault(c.name, {})
            for i, meta in zip(indexes, c.values):
                data = body.slice(meta.offset, meta.nbytes) if meta.nbytes else pa.py_buffer(b"")
                col[int(i)] = Stored(meta, data, segment)
        self.reserved -= nbytes
        self.used += nbytes
        part.nbytes += nbytes

    def unstore(self, partition: str, indexes: Sequence[int], columns: Iterable[str], nbytes: int) -> None:
        """Undo a store whose commit the controller refused."""
        part = self.parts.get(partition)
        if part is None:
            return
        for c in columns:
            col = part.columns.get(c, {})
            for i in indexes:
                col.pop(int(i), None)
        part.nbytes -= nbytes
        self.used -= nbytes

    # -- reads and frees -----------------------------------------------------------------------
    def fetch(self, partition: str, wanted: Sequence[tuple[str, Sequence[int]]]) -> list[tuple[str, list[Stored]]]:
        part = self.parts.get(partition)
        if part is None:
            raise DockNotFound(f"partition {partition!r} is not in this warehouse (cleared?)")
        out = []
        for name, indexes in wanted:
            col = part.columns.get(name)
            try:
                out.append((name, [col[i] for i in indexes]))
            except (KeyError, TypeError):
                missing = [i for i in indexes if col is None or i not in col]
                raise DockNotFound(
                    f"column {name!r} of samples {missing[:8]} of partition {partition!r} is not in this warehouse"
                ) from None
        return out

    def has(self, partition: str, wanted: Sequence[tuple[str, Sequence[int]]]) -> bool:
        part = self.parts.get(partition)
        if part is None:
            return False
        return all(c in part.columns and all(i in part.columns[c] for i in idx) for c, idx in wanted)

    def free(self, partition: str) -> int:
        part = self.parts.pop(partition, None)
        if part is None:
            return 0
        self.used -= part.nbytes
        return part.nbytes

    def free_all(self) -> int:
        return sum(self.free(p) for p in list(self.parts))

    def inventory(self, uncommitted: Sequence[pb.CommitRequest] = ()) -> list[pb.InventoryPartition]:
        """What this warehouse holds, as sorted index runs per column, leaving out stored values
        whose commit is still pending (`uncommitted`): those are re-committed separately."""
        skip: dict[tuple[str, str], set[int]] = {}
        for c in uncommitted:
            for name in c.columns:
                skip.setdefault((c.partition, name), set()).update(c.indexes)
        out = []
        for name, part in self.parts.items():
            inv = pb.InventoryPartition(name=name, group_size=part.group_size, nbytes=part.nbytes)
            for col, values in part.columns.items():
                drop = skip.get((name, col))
                idx = np.fromiter((i for i in values if not drop or i not in drop), dtype=np.int64)
                idx.sort()
                inv.columns.add(name=col, runs=_runs(idx))
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
