"""Shared memory a warehouse stores in and lends out: warm segments, readers' pins, writers' staging.

Fresh shared pages are slow to come by (the kernel zeroes and maps them at
about 1 GB/s on the development VM, against 10-20 GB/s for a copy into warm
memory), so a warehouse recycles its segments instead of creating one per put:

- **Storage.** A put body big enough for shared memory lands in a segment taken
  from the pool (warm once it has been used) and sealed against writes through
  any descriptor once filled; the warehouse keeps its own writable mapping.
- **Pins.** Every descriptor lent to a same-host reader (a fetch or inline
  reply) pins its segment for that reader's process, known from the Unix
  socket (SO_PEERCRED). The reader maps it copy-on-write and unpins it when the
  last tensor viewing the mapping is gone; a process that exits unpins all it
  held (a pidfd tells the event loop). A segment goes back to the pool only
  when its data was cleared *and* nobody pins it: a private mapping still shows
  the shared page until its owner writes to it, so refilling a segment a
  reader maps would change that reader's tensors.
- **Staging.** A same-host writer keeps a few memfds of its own warm, registers
  each once (its descriptor passes once, sealed against shrinking so that it
  cannot vanish under our mapping) and names one per put; the warehouse keeps
  them mapped read-only and copies the payload out into a pool segment. The
  writer's later writes never reach stored data.
"""

from __future__ import annotations

import collections
import logging
import os
import weakref
from collections.abc import Callable, Iterable

import numpy as np

from dockd.errors import DockProtocolError, StagingUnknown
from dockd.net import memfd
from dockd.warehouse.pending import Signal

logger = logging.getLogger(__name__)

STAGING_PER_PROCESS = 16


def size_class(n: int) -> int:
    """Segment size for a payload: rounded up to 4 classes per doubling, in whole pages (whole
    huge pages from 2 MiB). Payloads of nearby sizes share a class, so a freed segment is
    reused by the next put of about its size instead of waiting idle for one of exactly it."""
    n = memfd.padded(n)
    step = max(memfd.HUGE if n >= memfd.HUGE else memfd.PAGE, 1 << max(0, n.bit_length() - 3))
    return -(-n // step) * step


class Segments:
    """The segment pool, pins and staging buffers of one warehouse.

    Args:
        keep_bytes: idle segments kept for reuse; beyond it, freed segments are closed.
        keep_count: at most this many idle segments (each holds a descriptor).
        watch: called with a pid and a callback, to call back when that process exits
            (the daemon's event loop watches a pidfd); may be None (no watching).
    """

    def __init__(self, *, keep_bytes: int, keep_count: int = 1 << 30,
                 watch: Callable[[int, Callable[[], None]], object] | None = None) -> None:
        self.keep_bytes = keep_bytes
        self.keep_count = keep_count
        self.idle_count = 0
        self.watch = watch
        self._idle: dict[int, list[memfd.Segment]] = {}  # size class -> idle segments
        self._idle_order: collections.OrderedDict[int, memfd.Segment] = collections.OrderedDict()  # sid, oldest first
        self.idle_bytes = 0
        # sid -> segment taken from the pool (weak: one dropped before it was stored just goes away)
        self._live: weakref.WeakValueDictionary[int, memfd.Segment] = weakref.WeakValueDictionary()
        self._freed: dict[int, memfd.Segment] = {}  # data gone, waiting for its pins
        self._let_go: dict[int, int] = {}  # sid -> size of one freed past keep_count: readers hold its memory
        # called with +size when a segment's data is gone but a reader still maps it, -size when it no longer
        # does: the warehouse counts that memory against its capacity meanwhile (Admission)
        self.on_lent: Callable[[int], None] = lambda delta: None
        self.pins: dict[int, collections.Counter] = {}  # pid -> sid -> descriptors lent
        self._pinned: collections.Counter = collections.Counter()  # sid -> all pins
        # pid -> staging id -> read-only mapping
        self._staging: dict[int, collections.OrderedDict[int, np.ndarray]] = {}
        self._signals: dict[int, dict[int, Signal]] = {}  # pid -> staging id -> its eventfd (`dockd.warehouse.pending`)
        self._conns: collections.Counter = collections.Counter()  # pid -> its open same-host connections
        self.created = self.reused = 0
        # called with each segment created (dockd.net.mooncake registers it with its engine once)
        self.on_create: Callable[[memfd.Segment], object] | None = None

    # -- storage --------------------------------------------------------------------------------
    def take(self, size: int) -> memfd.Segment:
        """A segment for `size` payload bytes: a warm one from the pool if there is one."""
        cls = size_class(size)
        idle = self._idle.get(cls)
        if idle:
            seg = idle.pop()
            if not idle:
                del self._idle[cls]
            del self._idle_order[seg.sid]
            self.idle_bytes -= seg.size
            self.idle_count -= 1
            seg.use(size)
            self.reused += 1
        else:
            seg = memfd.Segment.create(size, "dockd-store", capacity=cls)
            self.created += 1
            if self.on_create is not None:
                self.on_create(seg)
        self._live[seg.sid] = seg
        return seg

    def release(self, seg: memfd.Segment) -> None:
        """Its data is gone (cleared, or the put failed): back to the pool once nobody maps it."""
        if seg.sid not in self._live:
            return
        if self._pinned[seg.sid]:
            if seg.sid in self._freed or seg.sid in self._let_go:
                return
            if len(self._freed) < self.keep_count:
                self._freed[seg.sid] = seg
            else:  # too many waiting already: let it go (readers keep its memory, not its descriptor)
                self._live.pop(seg.sid, None)
                self._let_go[seg.sid] = seg.size
            self.on_lent(seg.size)
        else:
            self._recycle(seg)

    def _recycle(self, seg: memfd.Segment) -> None:
        self._live.pop(seg.sid, None)
        if self._freed.pop(seg.sid, None) is not None:
            self.on_lent(-seg.size)
        self._pinned.pop(seg.sid, None)
        if seg.size > self.keep_bytes or self.keep_count < 1:
            return  # dropped: its descriptor and mapping go with the last reference
        self._idle.setdefault(seg.size, []).append(seg)
        self._idle_order[seg.sid] = seg
        self.idle_bytes += seg.size
        self.idle_count += 1
        while self.idle_bytes > self.keep_bytes or self.idle_count > self.keep_count:
            self._evict()

    def _evict(self) -> None:
        """Close the idle segment freed longest ago (the pool follows the sizes puts have now)."""
        _, old = self._idle_order.popitem(last=False)
        idle = self._idle[old.size]
        idle.remove(old)
        if not idle:
            del self._idle[old.size]
        self.idle_bytes -= old.size
        self.idle_count -= 1

    # -- pins ------------------------------------------------------------------------------------
    def lend(self, pid: int | None, segs: list[memfd.Segment]) -> None:
        """Descriptors of `segs` go to process `pid`: pinned until it unpins them or exits."""
        if pid is None:  # unknown reader (not on a Unix socket): never recycle what it may map
            for seg in segs:
                self._pinned[seg.sid] += 1 << 40
            return
        held = self.pins.get(pid)
        if held is None:
            held = self.pins[pid] = collections.Counter()
            if self.watch is not None:
                self.watch(pid, lambda: self.process_exited(pid))
        for seg in segs:
            held[seg.sid] += 1
            self._pinned[seg.sid] += 1

    def pinned(self, seg: memfd.Segment) -> bool:
        """Whether a reader (or the warehouse itself) maps `seg` now: its data must stay where it is."""
        return self._pinned.get(seg.sid, 0) > 0

    def hold(self, segs: Iterable[memfd.Segment]) -> None:
        """Keep segments from being reused while the warehouse itself reads them (a checkpoint)."""
        for seg in segs:
            self._pinned[seg.sid] += 1

    def unhold(self, segs: Iterable[memfd.Segment]) -> None:
        for seg in segs:
            self._drop_pin(seg.sid, 1)

    def unpin(self, pid: int | None, sids: Iterable[int]) -> None:
        """Process `pid` no longer maps these segments (once per descriptor it was lent)."""
        held = self.pins.get(pid) if pid is not None else None
        if held is None:
            return
        for sid in sids:
            if held[sid] <= 0:  # a process can only give back what it was lent
                continue
            held[sid] -= 1
            if not held[sid]:
                del held[sid]
            self._drop_pin(sid, 1)

    def _drop_pin(self, sid: int, n: int) -> None:
        self._pinned[sid] -= n
        if self._pinned[sid] <= 0:
            self._pinned.pop(sid, None)
            if sid in self._freed:
                self._recycle(self._freed[sid])
            elif sid in self._let_go:
                self.on_lent(-self._let_go.pop(sid))

    def process_exited(self, pid: int) -> None:
        held = self.pins.pop(pid, None)
        self._staging.pop(pid, None)
        self._signals.pop(pid, None)
        self._conns.pop(pid, None)
        if held:
            logger.debug("[shm] reader exited pid=%d pinned_segments=%d", pid, len(held))
            for sid, n in held.items():
                self._drop_pin(sid, n)

    # -- connections -----------------------------------------------------------------------------
    def connected(self, pid: int | None) -> None:
        """A same-host connection of process `pid` opened."""
        if pid is not None:
            self._conns[pid] += 1

    def disconnected(self, pid: int | None) -> None:
        """A same-host connection of process `pid` closed. Once it has none left, its staging
        buffers are unmapped: they belonged to its connections (a client registers them again
        on a new one). Its pins stay until it unpins or exits: it may still map what it read."""
        if pid is None or pid not in self._conns:
            return
        self._conns[pid] -= 1
        if self._conns[pid] <= 0:
            del self._conns[pid]
            self._staging.pop(pid, None)
            self._signals.pop(pid, None)

    # -- staging ---------------------------------------------------------------------------------
    def staging(self, pid: int | None, sid: int, fd: int | None, size: int, efd: int | None = None) -> np.ndarray:
        """The read-only mapping of a writer's staging buffer (registered now if `fd` is given; `efd`: its
        eventfd, registered with the buffer from now: see `signal`). Closes `fd` and `efd` (or keeps them)."""
        if pid is None:
            _close(efd)
            raise DockProtocolError("staging buffers are for same-host writers (a Unix socket)")
        bufs = self._staging.setdefault(pid, collections.OrderedDict())
        signals = self._signals.setdefault(pid, {})
        if fd is not None:
            signals.pop(sid, None)
            try:
                if memfd.seals(fd) & memfd.STAGING_SEALS != memfd.STAGING_SEALS:
                    raise DockProtocolError("a staging buffer must be sealed against shrinking (F_SEAL_SHRINK)")
                total = os.fstat(fd).st_size
                if not 0 < total <= 1 << 40:
                    raise DockProtocolError(f"a staging buffer of {total} bytes")
                bufs[sid] = memfd.map_shared(fd, total, readonly=True)
            finally:
                os.close(fd)
            if len(bufs) > STAGING_PER_PROCESS:
                signals.pop(bufs.popitem(last=False)[0], None)
            if pid not in self.pins:
                self.pins[pid] = collections.Counter()
                if self.watch is not None:
                    self.watch(pid, lambda: self.process_exited(pid))
        view = bufs.get(sid)
        if view is None:
            _close(efd)
            raise StagingUnknown(f"unknown staging buffer {sid}: send its descriptor again")
        if efd is not None:
            signals[sid] = Signal(efd)
        if size > len(view):
            raise DockProtocolError(f"a put of {size} bytes from a {len(view)}-byte staging buffer")
        bufs.move_to_end(sid)
        return view

    def signal(self, pid: int | None, sid: int) -> Signal:
        """The eventfd registered with staging buffer `sid` of process `pid` (`staging` registered the buffer)."""
        signal = self._signals.get(pid, {}).get(sid) if pid is not None else None
        if signal is None:  # (registered again, or never, since its eventfd: the writer passes both again)
            raise StagingUnknown(f"staging buffer {sid} has no eventfd registered: send its descriptor again")
        return signal

    def stats(self) -> dict:
        return {"live": len(self._live), "idle": self.idle_count, "idle_bytes": self.idle_bytes,
                "pinned": len(self._pinned), "created": self.created, "reused": self.reused}


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)
