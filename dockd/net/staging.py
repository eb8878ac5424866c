"""A same-host writer's staging buffers: memfds kept warm and registered with a warehouse once.

A put to a warehouse on this host copies its payload into a staging buffer and
names it; the warehouse (which maps each buffer once, when its descriptor
first rides on a put) copies the payload into its own storage. It may answer
before it copies the bulk of it (the buffer is *lent*: `PutReply.staging_lent`),
so that the writer's next put is encoded while the warehouse copies; a lent
buffer is written again only after a put sent after that answer is answered,
which the warehouse reads only once the copy is done. Writing into
memory that is already mapped and faulted in runs at memcpy speed, where a
fresh memfd per put ran at the speed the kernel hands out pages (about
1 GB/s on the development VM). Each buffer is sealed against shrinking, so a
warehouse never reads a mapping that vanished.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading

import numpy as np

from dockd.net import memfd

MIN_SIZE = 4 << 20


@dataclasses.dataclass(eq=False)
class StagingBuffer:
    id: int                  # random: names it to the warehouse, unique in this process
    fd: int
    size: int
    view: np.ndarray | None  # our writable mapping (None once dropped)
    registered: bool = False  # the warehouse has its descriptor


class Staging:
    """The staging buffers of one connection pool (one warehouse).

    Args:
        max_bytes: idle buffers kept; a put needing more gets a buffer that is dropped after it.
        max_buffers: buffers kept at most (the warehouse keeps a few per process mapped).
    """

    def __init__(self, *, max_bytes: int = 1 << 30, max_buffers: int = 8) -> None:
        self.max_bytes = max_bytes
        self.max_buffers = max_buffers
        self._free: list[StagingBuffer] = []
        self._lent: list[tuple[StagingBuffer, int]] = []  # (buffer, the lend's number)
        self._lends = 0  # buffers lent so far
        self._lock = threading.Lock()
        self.closed = False

    def take(self, n: int) -> StagingBuffer:
        """A buffer of at least `n` bytes (the smallest idle one that fits, else a new one)."""
        with self._lock:
            fits = [b for b in self._free if b.size >= n]
            if fits:
                buf = min(fits, key=lambda b: b.size)
                self._free.remove(buf)
                return buf
        size = max(MIN_SIZE, 1 << (n - 1).bit_length()) if n < (1 << 30) else memfd.padded(n)
        fd = os.memfd_create("dockd-staging", memfd.MFD_FLAGS)
        try:
            os.ftruncate(fd, size)
            memfd.seal(fd, memfd.STAGING_SEALS | memfd.F_SEAL_GROW)
            view = memfd.map_shared(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return StagingBuffer(secrets.randbits(62) + 1, fd, size, view)

    def mark(self) -> int:
        """Taken before a put is sent: once it is answered, `answered(mark)` frees the buffers
        that were lent before it was sent (the warehouse has copied out of them since)."""
        with self._lock:
            return self._lends

    def lend(self, buf: StagingBuffer) -> None:
        """The put is answered, and the warehouse copies out of `buf` before it reads the next request."""
        with self._lock:
            if not self.closed:
                self._lends += 1
                self._lent.append((buf, self._lends))
                return
        _drop(buf)

    def answered(self, mark: int) -> None:
        """A put sent after `mark` was taken is answered: the buffers lent up to then are free."""
        with self._lock:
            if not self._lent or self._lent[0][1] > mark:
                return
            free = [b for b, k in self._lent if k <= mark]
            self._lent = [(b, k) for b, k in self._lent if k > mark]
        for buf in free:
            self.give(buf)

    def give(self, buf: StagingBuffer) -> None:
        """The put is done: keep the buffer for the next one. Past the limits the buffers used
        longest ago go first: a writer whose puts grew keeps the size it writes now (dropping the
        largest instead made every put of a size near max_bytes fault in a fresh buffer)."""
        with self._lock:
            if not self.closed and buf.size <= self.max_bytes:
                self._free.append(buf)  # (most recently used last)
                while len(self._free) > self.max_buffers or sum(b.size for b in self._free) > self.max_bytes:
                    _drop(self._free.pop(0))
                return
        _drop(buf)

    def drop(self, buf: StagingBuffer) -> None:
        """A buffer not to be used again (the warehouse may still read what it holds)."""
        _drop(buf)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            free, self._free = self._free + [b for b, _ in self._lent], []
            self._lent = []
        for buf in free:
            _drop(buf)


def _drop(buf: StagingBuffer) -> None:
    if buf.fd >= 0:
        os.close(buf.fd)
        buf.fd = -1
    buf.view = None  # the mapping goes with the last reference
