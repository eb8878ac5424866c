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

Each buffer has an eventfd, passed (on a put of its own: a frame passes one
descriptor) once the buffer is registered: a put sent before its tensor parts
are copied in (`PutRequest.staging_pending`) is signalled through it once they
are (`signal`), and the warehouse commits it only after that. `StagedPut` is
one staged put's request, and what its answer does to its buffer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import threading

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError, DockError, StagingUnknown
from dockd.net import memfd
from dockd.net.transport import Put, Reply, Request

MIN_SIZE = 4 << 20


@dataclasses.dataclass(eq=False)
class StagingBuffer:
    id: int                  # random: names it to the warehouse, unique in this process
    fd: int
    size: int
    view: np.ndarray | None  # our writable mapping (None once dropped)
    registered: bool = False  # the warehouse has its descriptor
    efd: int = -1            # its eventfd (the copy-done signal of a put sent before its copy); -1: none
    signals: bool = False    # the warehouse has its eventfd too

    def ready(self) -> None:
        """About to be written for a put sent before its copy: any count a put whose answer did not wait
        for it left in the eventfd (one refused before its copy, or sent again once copied) is cleared,
        so that the warehouse's wait ends only on this put's signal. The buffer is ours alone here."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.efd)

    def signal(self) -> None:
        """The put's bytes are all in the buffer (the system call orders the copy before the warehouse's read)."""
        os.eventfd_write(self.efd, 1)


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
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) if hasattr(os, "eventfd") else -1
        return StagingBuffer(secrets.randbits(62) + 1, fd, size, view, efd=efd)

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
    if buf.efd >= 0:
        os.close(buf.efd)
        buf.efd = -1
    buf.view = None  # the mapping goes with the last reference


class StagedPut:
    """A put whose body is in staging buffer `buf`: sent naming it (with its descriptor until the
    warehouse has it), and the buffer then lent, given back or dropped as the answer says."""

    def __init__(self, staging: Staging, buf: StagingBuffer, mark: int, put: Put, copies: threading.local | None) -> None:
        self.staging, self.buf, self.mark, self.put = staging, buf, mark, put
        self.copies = copies  # a put sent before its tensors are copied in: where `idle` finds it
        self.retried = False

    def request(self) -> Request:
        """The put, passing the buffer's descriptor until the warehouse has it, then (one descriptor a
        frame) its eventfd with the first put sent before its copy."""
        buf, req = self.buf, self.put.req
        if self.copies is not None:
            self.copies.put = self  # (copied by the sending thread's `idle`, right after the send)
        req.staging_eventfd = buf.registered and req.staging_pending and not buf.signals
        fds = [buf.efd] if req.staging_eventfd else [] if buf.registered else [buf.fd]
        return Request(pb.Frame(put=req), fds=fds, timeout=self.put.answer_s, watch=self.put.alive,
                       answer=self.answered, failed=self.failed)

    def copy(self) -> None:
        """The tensors into the buffer (the put went already), then the signal the warehouse waits for. One
        that raises leaves the call's connection unanswered, so it is dropped: the warehouse drops the put."""
        self.copies = None
        self.put.req.staging_pending = False  # (a re-send after StagingUnknown finds the bytes in place)
        view = self.buf.view
        assert view is not None  # (dropped only once the put failed, and then it is not copied)
        self.put.body.write_late_into(memoryview(view))  # type: ignore[arg-type]  # (numpy declares __buffer__ only for Python 3.12+)
        self.buf.signal()

    def answered(self, reply: Reply) -> pb.Frame:
        self.buf.registered = True
        self.buf.signals = self.buf.signals or self.put.req.staging_eventfd
        self._done(lent=reply.frame.put_reply.staging_lent)
        return reply.frame

    def failed(self, exc: BaseException) -> Request | None:
        if self.copies is not None:  # not sent (no connection, a send that failed): never to be copied
            if getattr(self.copies, "put", None) is self:
                self.copies.put = None
            self.copies = None
            self.staging.drop(self.buf)  # (the warehouse may have part of it: not refilled under it)
            return None
        if isinstance(exc, StagingUnknown) and not self.retried:
            self.retried = True  # the warehouse dropped our registration (many buffers, a restart): pass it again
            self.buf.registered = self.buf.signals = False
            return self.request()
        if isinstance(exc, DockError) and not isinstance(exc, DockConnectionError):
            self._done(lent=False)  # (an answer, if an error: the warehouse is done with the buffer)
        else:
            # a put without an answer (a silent warehouse, a dropped connection) may still be taken in
            # when the warehouse resumes: its buffer is dropped, never refilled by another put under it
            self.staging.drop(self.buf)
        return None

    def _done(self, *, lent: bool) -> None:
        if lent:
            self.staging.lend(self.buf)
        else:
            self.staging.give(self.buf)
        self.staging.answered(self.mark)
