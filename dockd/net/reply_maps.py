"""Mappings of a daemon's segments that a same-host client keeps after their values are gone.

A same-host reply passes the descriptors of the segments its values are in, and the client maps them
copy-on-write (`dockd.net.same_host`). A fresh mapping costs the reader more than the mapping call: each of
its pages faults on the first read (on a 2-core VM, 1 MiB: mmap ~10 us, the reads' faults ~100 us, munmap
~23 us, against ~4 us to read resident memory). A warehouse recycles its segments (`dockd.warehouse.segments`),
so a client that streams batches is handed the same segments again and again: `ReplyMaps` keeps the mapping
of a segment whose values are all gone and maps the segment from it when a reply passes it again, its pages
still mapped.

A kept mapping must show what the segment holds, and nothing else: its segment is unpinned as soon as its
values are gone (the warehouse may fill it again, which a mapping of its pages shows), and it is kept only if
none of its pages was written (a write copies the page into private memory, which would then hide the
segment's bytes): `/proc/self/pagemap` tells, one read of 8 bytes a page. A mapping is never handed to two
replies at once (two gets of the same values stay private to each other).

The memory it holds: a kept mapping maps pages the warehouse owns, so while the warehouse keeps the segment
(stored data, or warm in its pool) it costs nothing more than the client's RSS counting the pages read; once
the warehouse closes the segment (its pool over its size), the pages live on until the client lets the
mapping go. So what a process keeps is bounded, over all its docks and daemons, by the budget
(`DOCKD_KEEP_MAPPINGS`, 64 MiB by default; 0 keeps none: every mapping is unmapped once its values are gone):
a mapping that would pass it is not kept. What is kept is not pushed out by newer mappings: a consumer that
reads more segments in turn than the budget holds (a partition put in full, then got in full) then finds most
of them kept on its next pass, where pushing out the least recently used found none (each was pushed out just
before its turn came again: 172 of 292 replies of `benchmarks/jagged_get` mapped from a kept mapping, 204-209
of 292 now). A kept mapping goes when it has not been used for `KEEP_IDLE_S` (a thread
of this module looks every `KEEP_IDLE_S` while anything is kept: gone within twice that), when its transport
closes (a Dock's close) or is collected, and in a child process at its fork.

A transport's close or collection may run in a finalizer, that is inside any allocation of any thread,
this module's own code under its lock included: letting go of what a transport kept never waits for the
lock (`_Kept.drop`). Waiting there deadlocked a thread on the lock it held.
"""

from __future__ import annotations

import collections
import itertools
import logging
import mmap
import os
import threading
import time
import weakref

import numpy as np

from dockd.net import memfd

logger = logging.getLogger(__name__)

KEEP_IDLE_S = 1.0
"""A kept mapping not passed again for this long is let go (a consumer that stopped, a segment the warehouse
closed): streaming gets pass their segments again within milliseconds."""

# pagemap: 8 bytes a page, little-endian; its top byte holds bit 63 present, 62 swapped, 61 file page or shared anon.
# A page is the segment's own when present and shared, or not mapped yet (neither present nor swapped): those top
# bytes are deleted from a mapping's, which leaves nothing when none of its pages was written.
_OWN_TOP_BYTES = bytes(b for b in range(256) if b & 0xE0 in (0x00, 0xA0))

Ident = tuple[int, int, int]  # a segment's (st_dev, st_ino, st_size)
_Key = tuple[int, int]  # (the ReplyMaps that kept it, segment id)


class _Kept:
    """The mappings this process keeps, over all its transports: least recently kept first (as the reaper
    looks at them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.maps: collections.OrderedDict[_Key, tuple[Ident, np.ndarray, float]] = collections.OrderedDict()
        self.bytes = 0
        self.pagemap = -1  # /proc/self/pagemap, opened on first use (-2: not readable here: keep none)
        self.reaping = False  # (a reaper thread runs)
        self.owners_gone: collections.deque[int] = collections.deque()  # owners to drop at the lock's next holder

    def take(self, key: _Key) -> tuple[Ident, np.ndarray, float] | None:
        with self.lock:
            got = self.maps.pop(key, None)
            if got is not None:
                self.bytes -= got[0][2]
            gone = self._drop_owners_gone()
        del gone  # (unmapped here, outside the lock)
        return got

    def put(self, key: _Key, ident: Ident, mm: np.ndarray, budget: int) -> list:
        """Keep `mm` (under the lock); returns what it pushed out, to drop outside the lock."""
        dropped = self._drop_owners_gone()
        old = self.maps.pop(key, None)  # (two replies mapped it at once: one mapping is enough)
        if old is not None:
            self.bytes -= old[0][2]
            dropped.append(old)
        if self.bytes + ident[2] > budget:  # (not kept: what is kept stays until unused for KEEP_IDLE_S)
            dropped.append((ident, mm, 0.0))
            return dropped
        self.maps[key] = (ident, mm, time.monotonic())
        self.bytes += ident[2]
        if not self.reaping:
            self.reaping = True
            threading.Thread(target=self._reap, name="dockd-reply-maps", daemon=True).start()
        return dropped

    def drop(self, owner: int) -> None:
        """Let go of every mapping that `owner` kept (its transport closed or was collected): now, or when
        the lock is held (maybe by this very thread, a finalizer having run inside its critical section),
        by its next holder, which the reaper is while anything is kept."""
        self.owners_gone.append(owner)
        if not self.lock.acquire(blocking=False):
            return
        try:
            gone = self._drop_owners_gone()
        finally:
            self.lock.release()
        del gone  # (unmapped here, outside the lock)

    def _drop_owners_gone(self) -> list:
        """(Under the lock.) The mappings of the owners `drop` was given, out of `maps`: to drop outside it."""
        if not self.owners_gone:  # (nearly every call)
            return []
        owners = set()
        while self.owners_gone:
            owners.add(self.owners_gone.popleft())
        gone = [self.maps.pop(k) for k in [k for k in self.maps if k[0] in owners]]
        self.bytes -= sum(g[0][2] for g in gone)
        return gone

    def _reap(self) -> None:
        """Let go of the mappings unused for KEEP_IDLE_S; ends once none is kept."""
        while True:
            time.sleep(KEEP_IDLE_S)
            with self.lock:
                gone = self._drop_owners_gone()
                old = time.monotonic() - KEEP_IDLE_S
                while self.maps and self.maps[key := next(iter(self.maps))][2] <= old:
                    gone.append(self.maps.pop(key))
                    self.bytes -= gone[-1][0][2]
                if not self.maps:
                    self.reaping = False
                    return
            del gone

    def unwritten(self, mm: np.ndarray) -> bool:
        """Whether every page of `mm` is still the segment's own (none written, so none copied)."""
        if self.pagemap == -1:
            with self.lock:  # (keeps run in the calling threads and in the flusher)
                if self.pagemap == -1:
                    try:
                        self.pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
                    except OSError as e:
                        logger.debug("[shm] /proc/self/pagemap is not readable (%s): reply mappings are not kept", e)
                        self.pagemap = -2
        pagemap = self.pagemap
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
        return not raw[7::8].translate(None, _OWN_TOP_BYTES)  # (~1 us for 256 pages, where numpy took ~6)

    def forked(self) -> None:
        """In a child process: its copies of the parent's mappings go, and /proc/self is the child's now."""
        self.lock = threading.Lock()
        maps, self.maps, self.bytes, self.reaping = self.maps, collections.OrderedDict(), 0, False
        self.owners_gone.clear()
        if self.pagemap >= 0:
            os.close(self.pagemap)
        self.pagemap = -1
        maps.clear()


_KEPT = _Kept()
_owners = itertools.count(1)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_KEPT.forked)


def kept_bytes() -> int:
    """Bytes of segments this process keeps mapped now (over all its transports)."""
    return _KEPT.bytes


class ReplyMaps:
    """The mappings one same-host transport keeps (see the module docstring); of them all, the process keeps
    `budget` bytes at most (0: none)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._owner = next(_owners)
        self._closed = False
        self.hits = self.misses = self.written = 0  # (replies mapped from a kept mapping, or anew; mappings not kept)
        weakref.finalize(self, _KEPT.drop, self._owner).atexit = False  # (collected: what it kept goes)

    def map(self, fd: int, sid: int, end: int) -> tuple[np.ndarray, Ident] | None:
        """Segment `fd` (lent under `sid`, its runs ending at byte `end`) whole, mapped copy-on-write: a kept
        mapping of it, else a new one; None when it is not for keeping (no budget, over it, no sid, runs past
        its end, closed): the caller maps the span it needs."""
        if not sid or self.budget <= 0 or self._closed or _KEPT.pagemap == -2:
            return None
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino, st.st_size)
        if not 0 < st.st_size <= self.budget or end > st.st_size:
            return None
        got = _KEPT.take((self._owner, sid))
        if got is not None and got[0] == ident:
            self.hits += 1
            return got[1], ident
        del got  # (another segment under that id: its mapping goes)
        self.misses += 1
        return memfd.map_whole_private(fd, st.st_size), ident

    def keep(self, sid: int, ident: Ident, mm: np.ndarray) -> None:
        """The values of `mm` (segment `sid`) are gone: keep it for the next reply that passes the segment
        if none of its pages was written, else let it go (unmapped when the caller drops its reference)."""
        if self._closed:  # (a close in a finalizer runs `idle`, so this: it keeps nothing, and waits for no lock)
            return
        if not _KEPT.unwritten(mm):
            self.written += 1
            return
        with _KEPT.lock:
            if self._closed:  # (closed meanwhile)
                return
            dropped = _KEPT.put((self._owner, sid), ident, mm, self.budget)
        del dropped  # (unmapped here, outside the lock)

    def clear(self) -> None:
        """Let every mapping kept go, and keep none from now on (the transport closes; maybe in a finalizer)."""
        self._closed = True  # (`keep` reads it again under the lock: one kept before that goes below, or with
        # the lock's next holder when `keep` holds it now)
        _KEPT.drop(self._owner)
