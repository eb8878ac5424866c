"""How a warehouse keeps stored values: per put a `_Body` (its bytes and their accounting), per
stored run a `_Batch` (a slice of the body, its dtype, shape and row offsets), per (partition,
column) a `_Column` mapping sample indexes to batches, per partition a `_Part`. The layout is
described in `dockd.warehouse.core`, whose `Warehouse` is the only writer of these."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa

from dockd._proto import dockd_pb2 as pb
from dockd.codec import ITEMSIZE
from dockd.errors import DockValueError
from dockd.warehouse import memory

SMALL_RUN = 8  # runs of at most this many values are filed with scalar code (a per-sample put's)

if TYPE_CHECKING:
    import torch

Indexes = Sequence[int] | np.ndarray


class Spilled(Protocol):
    """Where a spilled put's body is (`dockd.warehouse.spill.SpillFile`)."""

    path: str
    size: int

    @property
    def owned(self) -> bool:
        """Whether the file is the spill tier's (deleted with the put) rather than the data dir's."""

    def read(self) -> pa.Buffer:
        """The body (a read-only map of its file, or a private copy)."""

    def read_into(self, view: memoryview) -> None:
        """Copy the body into `view` (its size)."""


class _Body:
    """One put's body: its bytes are in use until every sample it holds is deleted."""

    __slots__ = ("nbytes", "meta", "dead", "device_nbytes", "segment", "live", "first_column", "batches", "file",
                 "buf", "spill", "file_layout")

    def __init__(self, nbytes: int, segment: object, live: int, first_column: str, device_nbytes: int = 0) -> None:
        self.nbytes = nbytes
        self.meta = 0
        self.dead = 0  # host bytes of its values that were deleted (held until it is compacted or freed)
        self.device_nbytes = device_nbytes
        self.segment = segment
        self.live = live                  # samples of this put not deleted yet
        self.first_column = first_column  # deletes are counted on this column's rows
        self.batches: list[tuple[str, int]] = []  # (column, batch id) of each of its runs
        self.file: str | None = None  # its file in the data dir (Warehouse.keeper), if any
        self.file_layout = False  # whether that file's body is laid out as `buf` (not after a compaction)
        self.buf: pa.Buffer | None = None  # the body its batches slice (None: spilled, or none)
        self.spill: Spilled | None = None  # where it is while spilled (dockd.warehouse.spill)


class _Batch:
    """One stored run: values back to back in `data`, for the samples `first`.. (consecutive
    indexes) or, when `order` is set, for the indexes `order` sorts into `keys`."""

    __slots__ = ("kind", "dtype", "shape", "unit", "ends", "lengths", "data", "device", "segment", "count", "first",
                 "keys", "order", "body", "at")

    def __init__(self, run: pb.Run, data: pa.Buffer | None, segment: object, rows: np.ndarray | list[int],
                 body: _Body | None = None,
                 device: torch.Tensor | None = None, first: int | None = None) -> None:
        """`first`: the rows are known to be consecutive from this index (then `rows` is not looked at)."""
        self.body = body
        self.at = (0, 0)  # while its put is spilled (data None): where its bytes are in the put's body
        self.device = device  # device tier: the run's bytes as a uint8 tensor (then data is None)
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
            kind = np.uint32 if small else np.uint64
            lengths = run.lengths[:]  # (a list: see dockd.net.wire)
            self.lengths = np.array(lengths, dtype=kind)
            if run.count <= SMALL_RUN:  # (a few values: Python sums)
                ends, total = [], 0
                for length in lengths:
                    total += length * self.unit
                    ends.append(total)
                self.ends = np.array(ends, dtype=kind)
            else:
                ends_ = np.cumsum(self.lengths, dtype=np.uint64)
                if self.unit != 1:
                    ends_ *= np.uint64(self.unit)
                self.ends = ends_.astype(np.uint32) if small else ends_
        if first is not None:
            self.first = first
            self.keys = self.order = None
            return
        n = len(rows)
        self.first = int(rows[0]) if n else 0
        if n <= SMALL_RUN:  # (scalar checks for a few rows)
            listed = rows.tolist() if isinstance(rows, np.ndarray) else list(rows)
            in_order = all(b - a == 1 for a, b in zip(listed, listed[1:]))
        else:
            arr = np.asarray(rows)
            in_order = int(arr[-1]) - self.first == n - 1 and bool((arr[1:] - arr[:-1] == 1).all())
        if in_order:
            self.keys = self.order = None
        else:  # indexes in any order (a put of existing samples): look rows up
            rows = np.asarray(rows, dtype=np.int64)
            self.order = np.argsort(rows, kind="stable").astype(np.int32)
            self.keys = rows[self.order]

    def indexes(self) -> np.ndarray:
        """The sample index of each row."""
        if self.order is None:
            return np.arange(self.first, self.first + self.count, dtype=np.int64)
        out = np.empty(self.count, dtype=np.int64)
        out[self.order] = self.keys
        return out

    def offsets(self) -> np.ndarray:
        """Byte offset of each row's start, and the end (count + 1 values)."""
        if self.ends is None:
            return np.arange(self.count + 1, dtype=np.int64) * self.unit
        return np.concatenate(([0], self.ends.astype(np.int64)))

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """Rows of samples `idx` (all stored in this batch)."""
        if self.order is None:
            return idx - self.first
        assert self.keys is not None  # (set together with order)
        return self.order[np.searchsorted(self.keys, idx)].astype(np.int64)

    def row(self, i: int) -> int:
        """The row of sample i (stored in this batch)."""
        if self.order is None:
            return i - self.first
        assert self.keys is not None and self.order is not None
        return int(self.order[int(np.searchsorted(self.keys, i))])

    def span(self, r0: int, r1: int) -> tuple[int, int]:
        """Byte range of rows [r0, r1) within the batch."""
        if self.ends is None:
            return r0 * self.unit, r1 * self.unit
        return (int(self.ends[r0 - 1]) if r0 else 0), int(self.ends[r1 - 1])

    def host(self, lo: int, n: int) -> pa.Buffer:
        """Bytes [lo, lo + n) in host memory (a view; a copy for a device-tier batch; a read of its
        file while its put is spilled)."""
        if self.data is None and self.device is None and self.body is not None and self.body.spill is not None:
            return self.body.spill.read().slice(self.at[0] + lo, n)
        if self.device is None:
            assert self.data is not None  # (a batch's bytes are in data or on the device)
            return self.data if lo == 0 and n == self.data.size else self.data.slice(lo, n)
        return pa.py_buffer(self.device[lo : lo + n].cpu().numpy())

    def add_run(self, runs: Any, r0: int, r1: int) -> tuple[pb.Run, int]:
        """Rows [r0, r1) as a run added to `runs` (a column's repeated field: built in place, not
        copied in; offset left to the caller), and where its bytes start in the batch."""
        lo, hi = self.span(r0, r1)
        out = runs.add(kind=self.kind, count=r1 - r0, dtype=self.dtype, shape=self.shape, nbytes=hi - lo)
        if self.lengths is not None:
            out.lengths.extend(self.lengths[r0:r1].tolist())
        return out, lo

    def measure(self, column: str, r0: int, r1: int) -> np.ndarray:
        """Per row of [r0, r1): its value when the run holds one number per sample, else its size (elements
        of the tensor; a ragged tensor's own length times its row size). See `Warehouse.measure`."""
        if self.kind == pb.MSGPACK:  # Python values: numbers count as themselves
            return _numbers(column, self, r0, r1)
        if self.ends is not None:  # ragged: the first dimension varies
            assert self.lengths is not None  # (set together with ends)
            sizes: np.ndarray = self.lengths[r0:r1].astype(np.float64) * math.prod(self.shape[1:])
            return sizes
        if self.shape == ():  # one number per sample: its value
            import torch

            from dockd.codec import DTYPES

            lo, hi = self.span(r0, r1)
            if hi <= lo:
                return np.zeros(0)
            raw = torch.frombuffer(bytearray(self.host(lo, hi - lo)), dtype=DTYPES[self.dtype])
            values: np.ndarray = raw.double().numpy()
            return values
        return np.full(r1 - r0, float(math.prod(self.shape)))


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

    def any_present(self, indexes: list[int]) -> bool:
        """Whether any of a few indexes is stored (scalar: no array work)."""
        batch_of, n = self.batch_of, len(self.batch_of)
        return any(0 <= i < n and batch_of[i] >= 0 for i in indexes)

    def batch(self, bid: int) -> _Batch:
        """A batch that batch_of names (one whose values are all deleted is named nowhere)."""
        b = self.batches[bid]
        assert b is not None
        return b

    def slices_small(self, indexes: list[int]) -> list[tuple] | None:
        """slices() for a few indexes, without array work (a small get's inline read costs ~10
        numpy calls otherwise); None if one is not stored here (the caller then says which)."""
        out: list[tuple] = []
        batch_of, n = self.batch_of, len(self.batch_of)
        for i in indexes:
            bid = int(batch_of[i]) if 0 <= i < n else -1
            if bid < 0:
                return None
            b = self.batch(bid)
            r = b.row(i)
            if out and out[-1][0] is b and out[-1][2] == r:
                out[-1] = (b, out[-1][1], r + 1)
            else:
                out.append((b, r, r + 1))
        return out

    def range_slices(self, first: int, n: int) -> list[tuple] | None:
        """slices() for the samples first .. first + n - 1 when batches in row order hold them, each a
        stretch of the range (a get of samples put together, over one put or a few: the common case), with
        two array calls per batch instead of slices()' ~20; None otherwise (a sample stored in a batch of
        any order or not at all: the caller takes the general path)."""
        batch_of, batches = self.batch_of, self.batches
        end = first + n
        if first < 0 or end > len(batch_of):
            return None
        out = []
        at = first
        while at < end:
            bid = int(batch_of[at])
            b = batches[bid] if bid >= 0 else None
            if b is None or b.order is not None:
                return None
            stop = min(end, b.first + b.count)  # (the batch holds at most its rows' indexes)
            if stop - at > 1 and not (batch_of[at:stop] == bid).all():
                return None
            r = at - b.first
            out.append((b, r, r + stop - at))
            at = stop
        return out

    def slices(self, idx: np.ndarray) -> list[tuple]:
        """Consecutive rows of one batch become one slice."""
        if not len(idx):
            return []
        b = self.batch_of[idx]
        if b[0] == b[-1] and (b == b[0]).all():  # the common case: all from one put
            r = self.batch(int(b[0])).rows(idx)
        else:
            bs = np.unique(b)
            if 4 * len(bs) > len(idx):  # (many puts of a few samples each: a get of per-sample puts)
                out = self.slices_small(idx.tolist())  # (~0.4 us per sample, where the loop below takes ~2.4 us per put)
                assert out is not None  # (the caller checked they are all stored)
                return out
            r = np.empty(len(idx), dtype=np.int64)
            for bid in bs.tolist():
                sel = b == bid
                r[sel] = self.batch(bid).rows(idx[sel])
        breaks = np.flatnonzero((b[1:] != b[:-1]) | (r[1:] != r[:-1] + 1)) + 1
        starts = np.concatenate(([0], breaks)).tolist()
        ends = np.concatenate((breaks, [len(idx)])).tolist()
        bl, rl = b.tolist(), r.tolist()
        return [(self.batches[bl[s]], rl[s], rl[e - 1] + 1) for s, e in zip(starts, ends)]


class _Part:
    __slots__ = ("columns", "nbytes", "meta", "dead", "device_nbytes", "group_size", "segments", "spilled", "bodies")

    def __init__(self) -> None:
        self.columns: dict[str, _Column] = {}
        self.nbytes = 0
        self.meta = 0
        self.dead = 0  # host bytes of deleted values its puts still hold
        self.device_nbytes = 0
        self.group_size = 0  # known once a put of new samples landed here
        self.segments: list = []  # shared-memory segments its puts landed in
        self.spilled = 0  # bytes of its puts spilled (not in nbytes)
        self.bodies: dict[int, _Body] = {}  # with a spill tier: its puts, by id


def _idx(indexes: Indexes) -> np.ndarray:
    return np.asarray(indexes, dtype=np.int64).reshape(-1)


def _first_of_range(idx: np.ndarray) -> int | None:
    """The first of `idx` if they are consecutive and rising (a put of new samples' indexes), else None."""
    n = len(idx)
    if not n:
        return None
    first = int(idx[0])
    if int(idx[-1]) - first != n - 1 or (n > 2 and not bool((idx[1:] - idx[:-1] == 1).all())):
        return None
    return first


def _numbers(column: str, b: _Batch, r0: int, r1: int) -> np.ndarray:
    import msgpack

    offs = b.offsets()
    data = memoryview(b.host(0, int(offs[-1])))
    out = np.empty(r1 - r0, dtype=np.float64)
    for k, r in enumerate(range(r0, r1)):
        try:
            v = msgpack.unpackb(data[offs[r]:offs[r + 1]])
        except Exception:  # noqa: BLE001 - an extension type (not a plain number)
            v = None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise DockValueError(f"column {column!r} holds Python values that are not numbers ({type(v).__name__}): "
                                 "it cannot weigh samples (balance_by); put the lengths as a tag or a numeric column")
        out[k] = v
    return out


def _runs(idx: np.ndarray) -> list[int]:
    """Sorted indexes as [start, stop) pairs, flattened."""
    if not len(idx):
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate([idx[:1], idx[breaks]])
    stops = np.concatenate([idx[breaks - 1] + 1, idx[-1:] + 1])
    return np.stack([starts, stops], axis=1).ravel().tolist()


def compacted(part: _Part, body: _Body) -> _Body:
    """A body holding only the live values of `body` (of partition `part`), each run 64-byte aligned, with
    their batches filed in its place (the old batches are dropped; the caller accounts for the bytes)."""
    plans, total = [], 0
    for name, bid in body.batches:
        col = part.columns[name]
        b = col.batches[bid]
        if b is None:
            continue
        keys = b.indexes()
        rows = np.flatnonzero(col.batch_of[keys] == bid)
        offs = b.offsets()
        starts, ends = offs[rows], offs[rows + 1]
        at = total
        total = -(-(at + int((ends - starts).sum())) // 64) * 64  # each run 64-byte aligned
        plans.append((name, col, bid, b, keys[rows], rows, starts, ends, at))
    new = memory.allocate(total)
    dst = np.frombuffer(new, dtype=np.uint8)
    owner = _Body(total, None, body.live, body.first_column)
    owner.meta = body.meta
    owner.file = body.file  # (the file keeps every value; the deleted ones are recorded apart)
    owner.buf = new
    for name, col, bid, b, idx, rows, starts, ends, at in plans:
        src = np.frombuffer(b.data, dtype=np.uint8) if b.data is not None and b.data.size else None
        pos = at
        if src is not None:  # consecutive rows are one copy
            breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1
            for lo, hi in zip(np.concatenate(([0], breaks)).tolist(), np.concatenate((breaks, [len(rows)])).tolist()):
                n = int(ends[hi - 1] - starts[lo])
                dst[pos : pos + n] = src[int(starts[lo]) : int(starts[lo]) + n]
                pos += n
        run = pb.Run(kind=b.kind, count=len(rows), dtype=b.dtype, shape=b.shape, nbytes=pos - at)
        if b.lengths is not None:
            run.lengths.extend(b.lengths[rows].tolist())
        data = new.slice(at, pos - at) if pos > at else pa.py_buffer(b"")
        col.batch_of[idx] = len(col.batches)
        owner.batches.append((name, len(col.batches)))
        col.batches.append(_Batch(run, data, None, idx, owner))
        col.batches[bid] = None
    return owner


def inventory(parts: dict[str, _Part], uncommitted: Sequence[pb.CommitRequest] = ()) -> list[pb.InventoryPartition]:
    """What `parts` hold, as sorted index runs per column, leaving out the values of `uncommitted`."""
    skip: dict[tuple[str, str], np.ndarray] = {}
    for c in uncommitted:
        for name in c.columns:
            prev = skip.get((c.partition, name))
            new = _idx(c.indexes)
            skip[(c.partition, name)] = new if prev is None else np.concatenate((prev, new))
    out = []
    for name, part in parts.items():
        inv = pb.InventoryPartition(name=name, group_size=part.group_size, nbytes=part.nbytes + part.spilled)
        for col_name, col in part.columns.items():
            idx = np.flatnonzero(col.batch_of >= 0)
            drop = skip.get((name, col_name))
            if drop is not None:
                idx = idx[~np.isin(idx, drop)]
            inv.columns.add(name=col_name, runs=_runs(idx))
        out.append(inv)
    return out
