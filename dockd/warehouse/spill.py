"""The spill tier (`dockd serve --spill-dir DIR [--spill-capacity SIZE]`): when host memory is full,
stored puts nobody is reading move to files, and come back on a fetch.

What moves: whole puts, least recently stored or read first (`Warehouse.lru`), and never
one whose shared-memory segment a same-host reader still maps (a pin: `Segments.pinned`),
nor one with device-tier bytes. A spilled put's memory goes (its segment back to the pool),
its bytes count against the spill space instead of `--capacity`; its bookkeeping (index
maps, `META_PUT`) stays in memory and keeps counting against `--capacity`.

Where it goes: an Arrow IPC file per put, `DIR/spill-<n>.arrow`, holding one record
batch of one `large_binary` value (the put's body as it was in memory, zero-copy from
the segment); the schema's metadata names the partition and the size. A put the data
dir (`--data-dir`) already holds in a file of the same layout is not written again: its
memory is dropped and reads come from the data-dir file (it takes no spill space).
Spill files are not fsync'd (nothing needs them after the process): until the kernel
writes them back they live in the page cache, which the kernel may reclaim.

When: a put that finds no room (`Warehouse.reserve`) spills what it needs before it
queues; a put already queued retries every `admission.RETRY_S` (a reader may have unpinned a
segment). Puts of `WRITE_OFF_LOOP` bytes or more are written by a worker thread (the
segment held meanwhile) and leave memory when their file is whole, unless they were
freed, compacted or mapped by a reader meanwhile (then the file goes); the queue is
let in again then. A put waits for room as before and fails with DockFull after its timeout only
when nothing more can be spilled (the spill space is exhausted, or all that is left is
pinned or in flight); the message names both limits.

Reading back (`Warehouse.fetch`): when the put fits in host memory now and no put waits
for room, it is restored whole into a fresh pool segment (private memory past the
descriptor budget or below the shared-memory size): a normal in-memory put again, zero-copy
for same-host readers, and its file is deleted. Otherwise the reply is served straight
from the file: a read-only memory map of the Arrow file (page cache, not counted against
`--capacity`; an unlinked file's map stays valid) or, for a data-dir file, a private copy of
its body (a data-dir file is rewritten in place once freed, so it is never mapped). Restoring
never spills another put: reads would otherwise evict what the next reads want.

Frees, deletes and clears remove the files. A restart discards whatever spill files the
last process left (`spill-*.arrow`, nothing else in DIR is touched); with `--data-dir` its
files bring every put back, spilling again what exceeds `--capacity`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from dockd.errors import DockValueError
from dockd.net import memfd
from dockd.node.tasks import spawn
from dockd.warehouse import memory
from dockd.warehouse.putfile import HEAD

if TYPE_CHECKING:
    from dockd.node.metrics import Metrics
    from dockd.warehouse.admission import Admission
    from dockd.warehouse.core import Warehouse
    from dockd.warehouse.layout import Spilled, _Batch, _Body, _Part
    from dockd.warehouse.segments import Segments

logger = logging.getLogger(__name__)

PREFIX, SUFFIX = "spill-", ".arrow"
MARGIN = 1 << 30  # without --spill-capacity: keep this much of the filesystem free (or 5% of it, if less)
WRITE_OFF_LOOP = 4 << 20
"""SpillFile for a put that can wait for its room (`make_room(background=True)`), a put this big is
written to its spill file by a worker thread and leaves memory once the file is whole (on the VM's disk
a 256 MiB spill written on the event loop left it answering nothing for 0.7-0.9 s)."""
_SCHEMA_KEY = b"dockd_spill"


class SpillFile:
    """Where a spilled put's body is: its own Arrow file, or (`offset` >= 0) its data-dir file at `offset`."""

    __slots__ = ("path", "offset", "size")

    def __init__(self, path: str, size: int, offset: int = -1) -> None:
        self.path = path
        self.size = size
        self.offset = offset

    @property
    def owned(self) -> bool:
        """Whether the file is the spill tier's (deleted with the put) rather than the data dir's."""
        return self.offset < 0

    def read(self) -> pa.Buffer:
        """The body: a read-only map of an Arrow file (zero-copy), or a private copy from a data-dir file."""
        if self.owned:
            with pa.memory_map(self.path, "r") as mm:
                col = pa.ipc.open_file(mm).get_batch(0).column(0)
            return col.buffers()[2].slice(0, self.size)
        buf = memory.allocate(self.size)
        self.read_into(memoryview(buf).cast("B"))
        return buf

    def read_into(self, view: memoryview) -> None:
        """Copy the body into `view` (its size)."""
        if self.owned:
            view[:] = memoryview(self.read()).cast("B")
            return
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            pos, off = 0, self.offset
            while pos < self.size:
                n = os.preadv(fd, [view[pos:]], off + pos)
                if n <= 0:
                    raise EOFError(f"{self.path} ends early")
                pos += n
        finally:
            os.close(fd)


def _write_file(path: str, partition: str, buf: pa.Buffer) -> None:
    """A put's body as an Arrow IPC file of one `large_binary` value (no state touched: a worker
    thread may run it)."""
    size = buf.size
    offsets = pa.py_buffer(np.array([0, size], dtype=np.int64).tobytes())
    arr = pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, buf])
    schema = pa.schema([("body", pa.large_binary())],
                       metadata={_SCHEMA_KEY: json.dumps({"partition": partition, "nbytes": size}).encode()})
    try:
        with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, schema) as writer:
            writer.write_batch(pa.record_batch([arr], schema=schema))
    except (OSError, pa.ArrowException) as e:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise OSError(str(e)) from None


class SpillTier:
    """The spill files of one warehouse; `Warehouse.tier` while it stores.

    Args:
        capacity: bytes of spill files at most (0: the filesystem's free space less a margin).
    """

    def __init__(self, path: str, capacity: int, *, warehouse: Warehouse, admission: Admission, segments: Segments,
                 metrics: Metrics) -> None:
        self.path = os.path.abspath(path)
        self.capacity = capacity
        self.warehouse = warehouse
        self.admission = admission
        self.segments = segments
        self.metrics = metrics
        self.bytes = 0  # bytes of spill files now
        self.files = 0
        self._next = 1
        self.full_reason = ""  # why the last spill stopped short (for DockFull's message)
        self.writing = 0  # bytes of puts being written by it (they leave memory when done)
        self._writing: set[int] = set()  # id() of their bodies

    def open(self) -> None:
        """Make the dir, and discard the spill files a previous process left."""
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            removed = 0
            for e in os.scandir(self.path):
                if e.name.startswith(PREFIX) and e.name.endswith((SUFFIX, ".tmp")) and e.is_file(follow_symlinks=False):
                    os.unlink(e.path)
                    removed += 1
        except OSError as e:
            raise DockValueError(f"cannot use --spill-dir {self.path}: {e.strerror or e}") from None
        if removed:
            logger.info("[spill] removed %d spill files of the previous process dir=%s", removed, self.path)
        self.warehouse.tier = self

    # -- room -------------------------------------------------------------------------------------
    def room(self) -> int:
        """Bytes more spill files may take now."""
        try:
            du = shutil.disk_usage(self.path)
            disk = du.free - min(MARGIN, du.total // 20)
        except OSError:
            disk = 0
        disk -= self.writing
        return max(0, min(disk, self.capacity - self.bytes - self.writing) if self.capacity else disk)

    def describe(self) -> str:
        """The spill space, for DockFull's message."""
        limit = f"of --spill-capacity {self.capacity}" if self.capacity else "(no --spill-capacity: up to the disk's free space less a margin)"
        return (f"the spill dir {self.path} holds {self.bytes} bytes {limit}, {self.room()} more fit there"
                + (f"; {self.full_reason}" if self.full_reason else ""))

    def make_room(self, nbytes: int, background: bool = False) -> None:
        """Spill puts, least recently used first, until `nbytes` more fit in host memory (or nothing more can go).
        With `background` (the caller waits for room, and is let in when it frees) big ones are written by
        the worker thread and leave memory later."""
        w = self.warehouse
        need = w.held() + nbytes - w.capacity - (self.writing if background else 0)
        if need <= 0:
            return
        self.full_reason = ""
        room = self.room()
        skipped_pinned = 0
        for partition, body in w.spill_candidates():
            if need <= 0:
                break
            if id(body) in self._writing:
                continue
            if isinstance(body.segment, memfd.Segment) and self.segments.pinned(body.segment):
                skipped_pinned += 1
                continue
            in_data_dir = body.file is not None and body.file_layout
            if not in_data_dir and body.nbytes > room:
                self.full_reason = f"a put of {body.nbytes} bytes did not fit in the spill space"
                continue
            if background and not in_data_dir and body.nbytes >= WRITE_OFF_LOOP:
                self._write_in_background(partition, body)
                room -= body.nbytes
                need -= body.nbytes
                continue
            try:
                where = self._write(partition, body) if not in_data_dir else self._in_data_dir(body)
            except OSError as e:
                self.full_reason = f"writing a spill file failed ({e.strerror or e})"
                logger.warning("[spill] cannot spill a put of %d bytes to %s: %s", body.nbytes, self.path, e)
                break
            if where.owned:
                room -= where.size
            seg = w.mark_spilled(partition, body, where)
            if isinstance(seg, memfd.Segment):
                self.segments.release(seg)
            self.metrics.spill_out_bytes += body.nbytes
            need -= body.nbytes
        if need > 0 and skipped_pinned and not self.full_reason:
            self.full_reason = f"{skipped_pinned} puts are mapped by same-host readers (pinned)"

    def _write(self, partition: str, body: _Body) -> SpillFile:
        buf = body.buf
        assert buf is not None  # (an in-memory put has its body)
        path = self._path()
        _write_file(path, partition, buf)
        self.files += 1
        self.bytes += buf.size
        return SpillFile(path, buf.size)

    def _path(self) -> str:
        n, self._next = self._next, self._next + 1
        return os.path.join(self.path, f"{PREFIX}{n:016x}{SUFFIX}")

    def _write_in_background(self, partition: str, body: _Body) -> None:
        """Write a put's spill file in the worker thread; it leaves memory once the file is whole, if it
        is still in memory as it was then (not freed, compacted or mapped by a reader meanwhile)."""
        buf = body.buf
        assert buf is not None  # (an in-memory put has its body)
        seg = body.segment if isinstance(body.segment, memfd.Segment) else None
        if seg is not None:  # (not reused while the thread reads it)
            self.segments.hold([seg])
        self._writing.add(id(body))
        self.writing += body.nbytes
        spawn(self._written(partition, body, buf, seg, self._path()))

    async def _written(self, partition: str, body: _Body, buf: pa.Buffer, seg: memfd.Segment | None,
                       path: str) -> None:
        try:
            await self.admission.in_worker(_write_file, path, partition, buf)
            done = True
        except Exception as e:  # noqa: BLE001 - the spill stops; the put waits for room as it would
            self.full_reason = f"writing a spill file failed ({e})"
            logger.warning("[spill] cannot spill a put of %d bytes to %s: %s", body.nbytes, self.path, e)
            done = False
        finally:
            if seg is not None:
                self.segments.unhold([seg])
            self._writing.discard(id(body))
            self.writing -= body.nbytes
        w = self.warehouse
        entry = w.lru.get(id(body))
        if done and (entry is None or entry[1] is not body or body.buf is not buf
                     or (seg is not None and self.segments.pinned(seg))):
            with contextlib.suppress(OSError):  # (freed, compacted, or a reader maps it now: it stays)
                os.unlink(path)
            done = False
        if done:
            self.files += 1
            self.bytes += buf.size
            old = w.mark_spilled(partition, body, SpillFile(path, buf.size))
            if isinstance(old, memfd.Segment):
                self.segments.release(old)
            self.metrics.spill_out_bytes += body.nbytes
        self.admission.admit_waiters()

    @staticmethod
    def _in_data_dir(body: _Body) -> SpillFile:
        assert body.file is not None and body.buf is not None
        fd = os.open(body.file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _, _, hlen, rlen, blen = HEAD.unpack(os.pread(fd, HEAD.size, 0))
        finally:
            os.close(fd)
        if blen < body.buf.size:
            raise OSError(f"{body.file} holds {blen} body bytes, the put {body.buf.size}")
        return SpillFile(body.file, body.buf.size, HEAD.size + hlen + rlen)

    def discard(self, where: Spilled) -> None:
        """A spilled put is gone (freed, cleared, or restored): its spill file goes too."""
        if not where.owned:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(where.path)
        self.files -= 1
        self.bytes -= where.size

    # -- reading back -----------------------------------------------------------------------------------
    def resolve(self, partition: str, part: _Part, out: list[tuple[str, list[tuple]]]) -> list[tuple[str, list[tuple]]]:
        """A fetch's slices (`Warehouse.fetch`) with their puts in memory: each spilled one restored, or (no
        room) its batches cloned onto a read of its file for this reply. Marks the puts as just read."""
        seen: dict[int, pa.Buffer | None] = {}
        clones: dict[int, _Batch] = {}
        lru = self.warehouse.lru
        for _, slices in out:
            for b, _, _ in slices:
                body = b.body
                if body is None or id(body) in seen:
                    continue
                key = id(body)
                if body.spill is not None:
                    seen[key] = self.bring_back(partition, part, body)
                else:
                    seen[key] = None
                    if key in lru:
                        lru.move_to_end(key)
        if not any(v is not None for v in seen.values()):
            return out
        res = []
        for name, slices in out:
            new = []
            for b, r0, r1 in slices:
                buf = seen.get(id(b.body)) if b.body is not None else None
                if buf is not None and b.data is None and b.device is None:
                    c = clones.get(id(b))
                    if c is None:
                        c = clones[id(b)] = copy.copy(b)
                        c.data, c.segment = buf.slice(b.at[0], b.at[1]), None
                    b = c
                new.append((b, r0, r1))
            res.append((name, new))
        return res

    def bring_back(self, partition: str, part: _Part, body: _Body) -> pa.Buffer | None:
        """A fetch wants a spilled put: restore it into memory when it fits now and no put waits for room
        (None: done, its batches point into memory again), else its body for this reply only."""
        w, where = self.warehouse, body.spill
        assert where is not None
        if not self.admission.waiters and w.reserve(body.nbytes, spill=False):
            try:
                dest = self.admission.allocate(where.size)
                if isinstance(dest, memfd.Segment):
                    where.read_into(memoryview(dest.writable()).cast("B")[: where.size])
                    dest.seal()
                    buf, seg = dest.buffer, dest
                else:
                    where.read_into(memoryview(dest).cast("B")[: where.size])
                    buf, seg = dest, None
            except BaseException:
                w.unreserve(body.nbytes)
                raise
            w.mark_restored(partition, part, body, buf, seg)
            self.discard(where)
            self.metrics.spill_restored_bytes += body.nbytes
            return None
        self.metrics.spill_read_bytes += body.nbytes
        return where.read()

    def stats(self) -> dict:
        return {"path": self.path, "files": self.files, "bytes": self.bytes, "capacity": self.capacity}
