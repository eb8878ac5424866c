"""Mappings of a daemon's segments that a same-host client keeps after their values are gone.

A same-host reply passes the descriptors of the segments its values are in, and the client maps them
copy-on-write (`dockd.net.same_host`). A fresh mapping costs the reader more than the mapping call: each of
its pages faults on the first read (on a 2-core VM, 1 MiB: mmap ~10 us, the reads' faults ~100 us, munmap
~23 us, against ~4 us to read resident memory). A warehouse recycles its segments (`dockd.warehouse.segments`),
so a client that streams batches is handed the same segments again and again: `ReplyMaps` keeps the mapping
of a segment whose values are all gone, up to a budget of bytes, and maps the segment from it when a reply
passes it again, its pages still mapped.

A kept mapping must show what the segment holds, and nothing else: its segment is unpinned as soon as its
values are gone (the warehouse may fill it again, which a mapping of its pages shows), and it is kept only if
none of its pages was written (a write copies the page into private memory, which would then hide the
segment's bytes): `/proc/self/pagemap` tells, one read of 8 bytes a page. A mapping is never handed to two
replies at once (two gets of the same values stay private to each other). A kept mapping holds its segment's
memory while it is kept: at most the budget, least recently used first out, and all of it when the
transport closes.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import threading

import numpy as np

from dockd.net import memfd

logger = logging.getLogger(__name__)

_PRESENT, _SWAPPED, _SHARED = 1 << 63, 1 << 62, 1 << 61  # pagemap: present, swapped, file page or shared anon
_STATES = np.uint64(_PRESENT | _SWAPPED | _SHARED)
_UNWRITTEN = np.uint64(_PRESENT | _SHARED)  # (a page of the segment's own; 0: not mapped yet)

Ident = tuple[int, int, int]  # a segment's (st_dev, st_ino, st_size)


class ReplyMaps:
    """The mappings one same-host transport keeps (see the module docstring); `budget` bytes at most, 0: none."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._kept: collections.OrderedDict[int, tuple[Ident, np.ndarray]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._pagemap = -1  # /proc/self/pagemap, opened on first use (-2: not readable here: keep none)
        self.hits = self.misses = self.written = 0  # (replies mapped from a kept mapping, or anew; mappings not kept)

    def map(self, fd: int, sid: int, end: int) -> tuple[np.ndarray, Ident] | None:
        """Segment `fd` (lent under `sid`, its runs ending at byte `end`) whole, mapped copy-on-write: a kept
        mapping of it, else a new one; None when it is not for keeping (no budget, over it, no sid, runs past
        its end): the caller maps the span it needs."""
        if not sid or self.budget <= 0 or self._pagemap == -2:
            return None
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino, st.st_size)
        if not 0 < st.st_size <= self.budget or end > st.st_size:
            return None
        with self._lock:
            got = self._kept.pop(sid, None)
            if got is not None:
                self._bytes -= got[0][2]
        if got is not None and got[0] == ident:
            self.hits += 1
            return got[1], ident
        del got  # (another segment under that id: its mapping goes)
        self.misses += 1
        return memfd.map_whole_private(fd, st.st_size), ident

    def keep(self, sid: int, ident: Ident, mm: np.ndarray) -> None:
        """The values of `mm` (segment `sid`) are gone: keep it for the next reply that passes the segment
        if none of its pages was written, else let it go (unmapped when the caller drops its reference)."""
        if not self._unwritten(mm):
            self.written += 1
            return
        dropped = []
        with self._lock:
            if self._pagemap == -2:  # (closed meanwhile)
                return
            old = self._kept.pop(sid, None)  # (two replies mapped it at once: one mapping is enough)
            if old is not None:
                self._bytes -= old[0][2]
                dropped.append(old)
            self._kept[sid] = (ident, mm)
            self._bytes += ident[2]
            while self._bytes > self.budget:
                _, gone = self._kept.popitem(last=False)
                self._bytes -= gone[0][2]
                dropped.append(gone)
        del dropped  # (unmapped here, outside the lock)

    def clear(self) -> None:
        """Let every kept mapping go (the transport closes)."""
        with self._lock:
            kept, self._kept, self._bytes = self._kept, collections.OrderedDict(), 0
            pagemap, self._pagemap = self._pagemap, -2
        kept.clear()
        if pagemap >= 0:
            os.close(pagemap)

    def _unwritten(self, mm: np.ndarray) -> bool:
        """Whether every page of `mm` is still the segment's own (none written, so none copied)."""
        if self._pagemap == -1:
            with self._lock:  # (idle runs in the calling thread and in the flusher)
                if self._pagemap == -1:
                    try:
                        self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
                    except OSError as e:
                        logger.debug("[shm] /proc/self/pagemap is not readable (%s): reply mappings are not kept", e)
                        self._pagemap = -2
        pagemap = self._pagemap
        if pagemap < 0:
            return False
        addr = mm.__array_interface__["data"][0]
        pages = -(-mm.size // mmap.PAGESIZE)
        try:
            raw = os.pread(pagemap, pages * 8, addr // mmap.PAGESIZE * 8)
        except OSError:
            return False
        if len(raw) != pages * 8:
            return False
        states = np.frombuffer(raw, dtype=np.uint64) & _STATES
        return bool(((states == 0) | (states == _UNWRITTEN)).all())
