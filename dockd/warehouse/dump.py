"""Checkpoints of what a warehouse holds of a partition: dump to a file, or load a file's samples.

The file is Arrow IPC: one record batch per stored run (the column, each
sample's index and its value as bytes, and which dtype/shape descriptor the
run has), the partition's columns, descriptors and group size in the schema's
metadata. `snapshot` takes what a warehouse holds as such batches (views of the
stored buffers, no copy) and `Dump.write` writes them; `read` reads a file back
as runs to store.

`Checkpoints` serves the daemon's dump requests: the file work runs in a
thread, the stored buffers being written kept from reuse meanwhile. A load
reserves the file's bytes at once (DockFull when they do not fit) and stores
its samples as they were.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import stat
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dockd._proto import dockd_pb2 as pb
from dockd.codec import ITEMSIZE
from dockd.errors import DockFull, DockNotFound, DockValueError
from dockd.warehouse import memory
from dockd.warehouse.core import Warehouse
from dockd.warehouse.segments import Segments

logger = logging.getLogger(__name__)


class Checkpoints:
    def __init__(self, warehouse: Warehouse, segments: Segments, *, wid: Callable[[], int],
                 check_warehouse: Callable[[], None]) -> None:
        self.warehouse = warehouse
        self.segments = segments
        self._wid = wid
        self.check_warehouse = check_warehouse

    async def dump(self, req: pb.DumpRequest) -> pb.DumpReply:
        """Write what this warehouse holds of a partition to a checkpoint file, or (req.load) store a file's samples."""
        if req.load:
            return await self._load(req)
        dump = snapshot(self.warehouse, req.partition)
        self.segments.hold(dump.segments)
        try:
            await asyncio.get_running_loop().run_in_executor(None, dump.write, req.path)
        finally:
            self.segments.unhold(dump.segments)
        return pb.DumpReply(samples=dump.samples, nbytes=dump.nbytes)

    async def _load(self, req: pb.DumpRequest) -> pb.DumpReply:
        self.check_warehouse()
        w = self.warehouse
        entries, group_size = await asyncio.get_running_loop().run_in_executor(None, read, req.path,
                                                                               req.limit or None)
        total = sum(n for *_, n in entries)
        if not w.reserve(total):
            raise DockFull(f"warehouse {self._wid()} has no room for the {total} bytes of {req.path}: "
                           f"{w.used} of {w.capacity} bytes are in use")
        for idx, col, buf, n in entries:
            w.store(req.partition, idx, [col], buf, n, None, group_size)
        samples = len(np.unique(np.concatenate([idx for idx, *_ in entries]))) if entries else 0
        logger.info("[warehouse] checkpoint loaded partition=%s file=%s samples=%d bytes=%d", req.partition,
                    req.path, samples, total)
        return pb.DumpReply(samples=samples, nbytes=total)


def snapshot(w: Warehouse, partition: str) -> Dump:
    """What warehouse `w` holds of a partition, as record batches to write with `Dump.write`
    (in another thread if need be: the batches view stored buffers, whose segments
    `Dump.segments` lists for the caller to keep from reuse meanwhile)."""
    part = w.parts.get(partition)
    if part is None:
        raise DockNotFound(f"partition {partition!r} is not in this warehouse")
    descs: list[dict] = []
    desc_of: dict[tuple, int] = {}
    names = list(part.columns)
    schema = pa.schema([("column", pa.int32()), ("index", pa.int64()), ("desc", pa.int32()),
                        ("value", pa.large_binary())])
    batches, held, nbytes = [], [], 0
    for ci, name in enumerate(names):
        col = part.columns[name]
        for bid, b in enumerate(col.batches):
            if b is None:
                continue
            idx = b.indexes()
            live = np.flatnonzero(col.batch_of[idx] == bid) if len(idx) else idx
            if not len(live):
                continue
            d = (int(b.kind), b.dtype, b.shape)
            k = desc_of.get(d)
            if k is None:
                k = desc_of[d] = len(descs)
                descs.append({"kind": d[0], "dtype": d[1], "shape": list(d[2])})
            off = b.offsets()
            values = pa.LargeBinaryArray.from_buffers(pa.large_binary(), b.count,
                                                      [None, pa.py_buffer(off.tobytes()), b.host(0, int(off[-1]))])
            rb = pa.record_batch([pa.array(np.full(b.count, ci, np.int32)), pa.array(idx),
                                  pa.array(np.full(b.count, k, np.int32)), values], schema=schema)
            if len(live) < b.count:
                rb = rb.take(pa.array(live))
            batches.append(rb)
            held.append(idx[live])
            nbytes += int((off[live + 1] - off[live]).sum())
    meta = {b"dockd": json.dumps({"partition": partition, "columns": names, "descs": descs,
                                  "group_size": part.group_size}).encode()}
    samples = len(np.unique(np.concatenate(held))) if held else 0
    return Dump(schema.with_metadata(meta), batches, samples, nbytes, list(part.segments))


def read(path: str, limit: int | None = None) -> tuple[list[tuple[np.ndarray, pb.ColumnData, pa.Buffer, int]], int]:
    """Read a file written from a `snapshot`: per stored run, (indexes, the column as one run, a fresh
    buffer holding its values, bytes) ready to `store`, and the partition's group size.
    Samples with index >= limit are skipped."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a device would block or never end a read
            raise DockValueError(f"checkpoint file {path} is not a regular file")
        src = pa.memory_map(path)
    except FileNotFoundError:
        raise DockNotFound(f"checkpoint file {path} is missing") from None
    with src:
        try:
            reader = pa.ipc.open_file(src)
        except pa.ArrowInvalid as e:
            raise DockValueError(f"{path} is not a dockd checkpoint file: {e}") from None
        raw = (reader.schema.metadata or {}).get(b"dockd")
        if raw is None:
            raise DockValueError(f"{path} is not a dockd checkpoint file")
        meta = json.loads(raw)
        out = []
        for i in range(reader.num_record_batches):
            rb = reader.get_batch(i)
            if limit is not None:
                rb = rb.filter(pc.less(rb.column(1), pa.scalar(limit, pa.int64())))
            if not rb.num_rows:
                continue
            ci = rb.column(0).to_numpy()
            di = rb.column(2).to_numpy()
            if (ci != ci[0]).any() or (di != di[0]).any():
                raise DockValueError(f"{path}: a record batch mixes columns or descriptors")
            d = meta["descs"][int(di[0])]
            values = rb.column(3)
            off = np.frombuffer(values.buffers()[1], dtype=np.int64)[values.offset: values.offset + len(values) + 1]
            lo, hi = int(off[0]), int(off[-1])
            data = memory.allocate(hi - lo)
            if hi > lo:
                memoryview(data).cast("B")[:] = memoryview(values.buffers()[2]).cast("B")[lo:hi]
            run = pb.Run(kind=d["kind"], count=len(values), dtype=d["dtype"], shape=d["shape"], offset=0,
                         nbytes=hi - lo)
            if d["kind"] == pb.MSGPACK or (d["shape"] and d["shape"][0] == -1):
                unit = 1 if d["kind"] == pb.MSGPACK else math.prod(d["shape"][1:]) * ITEMSIZE[d["dtype"]]
                run.lengths.extend((np.diff(off) // max(unit, 1)).tolist())
            col = pb.ColumnData(name=meta["columns"][int(ci[0])], runs=[run])
            out.append((rb.column(1).to_numpy().astype(np.int64), col, data, hi - lo))
    return out, int(meta.get("group_size") or 1)


class Dump:
    """A partition's data on one warehouse, ready to be written as an Arrow IPC file."""

    def __init__(self, schema: pa.Schema, batches: list, samples: int, nbytes: int, segments: list) -> None:
        self.schema, self.batches, self.samples, self.nbytes, self.segments = schema, batches, samples, nbytes, segments

    def write(self, path: str) -> None:
        """Write the file (its directory made if need be), whole or not at all."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp"
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, self.schema) as writer:
            for rb in self.batches:
                writer.write_batch(rb)
        os.replace(tmp, path)
