"""Reading frames inside a daemon's event loop: the receiving half of a `dockd.net.peer.Peer`.

`FrameReader` is an asyncio BufferedProtocol (uvloop where available): small frames are parsed
from a reused scratch buffer; a body goes straight into a freshly allocated Arrow buffer or
segment (the storage it will live in, `_allocate`), so a put is received with no extra copy. A
body may be held back (`_admit`): reading pauses, which pushes back on the sender through TCP,
until it is let in or rejected (then the body is read and dropped, and the frame answered with
the error). What to do with each frame is the subclass's (`_dispatch`).

Until the peer has authenticated (`role` is None) frames are small and bodiless. Afterwards a
frame started must keep arriving: `frame_fault` says when one went `stall_timeout` seconds without a
byte, or averages under `min_rate` bytes a second once it has taken `RATE_GRACE` seconds (one that
averages exactly `min_rate` is received to its end).

Memory held across connections is bounded: a header larger than the scratch buffer is received
into memory counted against one budget for the whole process (`header_budget`); a connection whose
header does not fit is closed with an error saying so, and the others keep their room. Descriptors
sent ahead of the frames that claim them are bounded per connection (`MAX_QUEUED_FDS`) and for the
process (`fd_budget`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import ClassVar

import pyarrow as pa
from mypy_extensions import mypyc_attr

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockAuthError, DockError, DockProtocolError
from dockd.net import wire

logger = logging.getLogger(__name__)

_SCRATCH = 64 << 10   # per connection; grows for large headers and shrinks back once they are parsed
_DISCARD = 1 << 20
HANDSHAKE_HEADER = 4096       # bytes a frame may have before the peer authenticated
MAX_QUEUED_FDS = 64           # descriptors received ahead of the frames that claim them
_TIMED_MAX = 4096             # requests of one connection timed at once (the rest go untimed)
RATE_GRACE = 10.0             # seconds a frame may take before its average rate is checked


def too_slow(got: int, elapsed: float, min_rate: int) -> bool:
    """Whether a frame that has taken `elapsed` seconds to bring `got` bytes is cut: once past RATE_GRACE,
    when it averages under `min_rate`. One at exactly `min_rate` is not: it is received to its end."""
    return elapsed > RATE_GRACE and got < min_rate * elapsed


@mypyc_attr(allow_interpreted_subclasses=True)  # (compiled, it may still be subclassed in Python: the tests do)
class FrameReader(asyncio.BufferedProtocol):
    """Frames off one connection, each body into its destination; see the module docstring."""

    stall_timeout: ClassVar[float] = 60.0  # seconds a frame started may go without a byte
    min_rate: ClassVar[int] = 64 << 10   # bytes/s a frame must average once it has taken RATE_GRACE seconds
    fd_budget: ClassVar[int] = 4096      # descriptors all connections may have received ahead of their frames
    fds_held: ClassVar[int] = 0          # ... held now
    header_budget: ClassVar[int] = 256 << 20  # bytes of grown receive buffers (large headers) all connections may hold
    header_held: ClassVar[int] = 0       # ... held now

    def __init__(self, *, max_body: int, max_header: int, metrics=None) -> None:
        self.max_body = max_body
        self.max_header = max_header  # (an outgoing connection reads replies: larger headers)
        self.metrics = metrics        # a dockd.node.metrics.Metrics: requests are timed from their arrival
        self.role: str | None = None  # the peer's proven role; None: not authenticated yet
        self.transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # (kept: get_running_loop() calls getpid each time)
        self.name = "?"
        self.closed = False
        self._last = 0.0  # loop time of the last byte received
        self._buf = bytearray(_SCRATCH)
        self._mv = memoryview(self._buf)
        self._lo = self._hi = 0
        self._frame_t0: float | None = None  # when the frame now arriving in pieces began to (loop time)
        self._frame_got = 0                  # ... and its bytes received since
        self._pending: tuple[pb.Frame, int] | None = None  # frame whose body is next
        self._admitting = False
        self._dest: memoryview | None = None
        self._dest_obj: pa.Buffer | None = None
        self._dest_pos = 0
        self._discard_left = 0
        self._reject: BaseException | None = None
        self._fds: collections.deque[int] = collections.deque()  # received, not yet claimed by a frame
        self._frame_fds: list[int] = []
        self.on_body_done: Callable[[], None] | None = None  # called once the admitted body is in (or will not be)
        self._started: dict[int, tuple[str, float]] = {}  # request id -> (kind, arrival), until its reply

    # -- what a subclass does with frames ---------------------------------------------------
    def _dispatch(self, frame: pb.Frame, body) -> None:
        """A whole frame (its body: None, a pa.Buffer, or what `_allocate` gave), its descriptors in `_frame_fds`."""
        raise NotImplementedError

    def _admit(self, frame: pb.Frame, body_size: int) -> Awaitable[None] | None:
        """None: take the body now; else reading waits for it (its exception: the body is rejected)."""
        raise NotImplementedError

    def _allocate(self, size: int):
        """The body's destination: a pa.Buffer, or an object with `writable()` (a memfd.Segment)."""
        raise NotImplementedError

    def _abandoned(self, frame: pb.Frame, body_size: int) -> None:
        """An admitted body that will not arrive (the connection closed)."""
        raise NotImplementedError

    def _rejected(self, frame: pb.Frame, exc: BaseException) -> None:
        """A body read and dropped because its admission failed with `exc`."""
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:
        """Bad input: close the connection, saying why."""
        raise NotImplementedError

    # -- asyncio protocol ---------------------------------------------------------------------
    def fds_received(self, fds: list[int]) -> None:
        self._fds.extend(fds)
        FrameReader.fds_held += len(fds)
        if len(self._fds) > MAX_QUEUED_FDS or self.role is None:
            self.fail(DockProtocolError(f"{len(self._fds)} descriptors sent ahead of the frames that use them"))
        elif FrameReader.fds_held > self.fd_budget:
            self.fail(DockProtocolError(f"this daemon holds {FrameReader.fds_held} descriptors sent ahead of their "
                                        f"frames by all connections (at most {self.fd_budget}); retry"))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._dest is not None:
            return self._dest[self._dest_pos :]
        if self._hi == len(self._buf):
            self._compact(len(self._buf) * 2 if self._lo == 0 else 0)
        return self._mv[self._hi :]

    def _now(self) -> float:
        """The event loop's time."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop.time()

    def buffer_updated(self, nbytes: int) -> None:
        loop = self._loop  # (inline: a method call here costs more than the lookup, interpreted)
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        self._last = loop.time()
        self._frame_got += nbytes
        self._guarded(self._received, nbytes)

    def _received(self, nbytes: int) -> None:
        if self._dest is not None:
            self._dest_pos += nbytes
            if self._dest_pos == len(self._dest):
                self._body_filled()
            return
        self._hi += nbytes
        self._parse()

    def _guarded(self, step, *args) -> None:
        """Run a reading step: bad input closes this connection (saying why), never the daemon."""
        try:
            step(*args)
        except (DockProtocolError, DockAuthError) as e:
            self.fail(e)
        except Exception as e:  # a bug must not take the daemon down: drop this connection only
            logger.exception("[peer] failed to handle input peer=%s", self.name)
            self.fail(DockProtocolError(f"internal error while reading a frame: {e}"))

    def eof_received(self) -> bool:
        return False

    # -- the receive buffer -------------------------------------------------------------
    def _hold(self, size: int) -> None:
        """Count a receive buffer of `size` bytes (what it holds past the scratch size) against
        the process's header budget; refuses (closing this connection) past it."""
        delta = max(size - _SCRATCH, 0) - max(len(self._buf) - _SCRATCH, 0)
        if delta > 0 and FrameReader.header_held + delta > self.header_budget:
            raise DockProtocolError(
                f"this daemon holds {FrameReader.header_held >> 20} MiB of large request headers from other connections "
                f"(at most {self.header_budget >> 20} MiB) and cannot take {delta >> 20} MiB more now; retry, or "
                "split the request")
        FrameReader.header_held += delta

    def _shrink(self) -> None:
        """Back to the scratch buffer (its room in the header budget given back)."""
        if len(self._buf) != _SCRATCH:
            self._hold(_SCRATCH)
            self._buf = bytearray(_SCRATCH)
            self._mv = memoryview(self._buf)
            self._lo = self._hi = 0

    def _compact(self, grow: int = 0) -> None:
        live = self._hi - self._lo
        if grow:
            self._hold(max(grow, live))
            new = bytearray(max(grow, live))
            new[:live] = self._mv[self._lo : self._hi]
            self._buf, self._mv = new, memoryview(new)
        else:
            self._mv[:live] = self._mv[self._lo : self._hi]
        self._lo, self._hi = 0, live

    # -- frames -----------------------------------------------------------------------------
    def _parse(self) -> None:
        while self._pending is None and not self.closed:
            avail = self._hi - self._lo
            if avail < wire.PREFIX.size:
                break
            hlen, blen = wire.parse_prefix(self._buf, self._lo, self.max_body, self.max_header)
            if self.role is None and (hlen > HANDSHAKE_HEADER or blen):
                raise DockAuthError("authenticate first: the first frames on a connection are small and bodiless")
            need = wire.PREFIX.size + hlen
            if avail < need:
                self._arriving()
                if need > len(self._buf) - self._lo:
                    # grow with what has arrived, never to what a prefix merely announces
                    self._compact(grow=min(need, max(2 * len(self._buf), avail + _SCRATCH)))
                break
            start = self._lo + wire.PREFIX.size
            frame = wire.parse_header(self._mv[start : start + hlen])
            self._lo += need
            reply = frame.reply
            if reply and blen:
                raise DockProtocolError("a reply to a daemon carries no body")
            if self.metrics is not None and not reply and self.role is not None and not frame.oneway \
                    and len(self._started) < _TIMED_MAX:
                kind = frame.WhichOneof("kind")
                if kind is not None:  # (a bare frame only gives pins back: it has no reply)
                    self._started[frame.id] = (kind, time.perf_counter())
            if frame.fds:
                if frame.fds > len(self._fds):
                    raise DockProtocolError(f"frame announces {frame.fds} descriptors but {len(self._fds)} arrived")
                self._frame_fds = [self._fds.popleft() for _ in range(frame.fds)]
                FrameReader.fds_held -= frame.fds
            if blen == 0:
                self._dispatch(frame, None)
                continue
            self._pending = (frame, blen)
            wait = None if reply else self._admit(frame, blen)
            if wait is not None:
                assert self.transport is not None  # (reading: connected)
                self._admitting = True
                self.transport.pause_reading()
                asyncio.ensure_future(wait).add_done_callback(self._admitted)
                return
            self._start_body()
        if self._lo == self._hi:
            self._lo = self._hi = 0
            if self._dest is None:
                self._frame_t0 = None
            if len(self._buf) > 4 * _SCRATCH and self._dest is None:
                self._shrink()

    def _admitted(self, fut: asyncio.Future) -> None:
        self._guarded(self._resume, fut)

    def _resume(self, fut: asyncio.Future) -> None:
        """A held-back body was let in (or rejected): read it, then the frames after it."""
        # (locals, not the attributes, are narrowed: `_start_body` clears `_pending` once the body is in, and a
        # compiled module would check the attribute's narrowed type where it is read again below)
        pending, transport = self._pending, self.transport
        assert pending is not None and transport is not None  # (the frame admitted; connected)
        self._admitting = False
        if self.closed:
            if not fut.cancelled() and fut.exception() is None:
                self._abandoned(*pending)
            self._pending = None
            return
        self._reject = fut.exception() if not fut.cancelled() else DockError("admission cancelled")
        self._start_body()
        transport.resume_reading()
        if self._dest is None and self._pending is None:
            self._parse()

    def _start_body(self) -> None:
        assert self._pending is not None  # (the frame whose body is next)
        frame, blen = self._pending
        take = min(self._hi - self._lo, blen)
        if self._reject is not None:
            self._lo += take
            self._discard_left = blen - take
            if self._discard_left == 0:
                self._finish_reject()
            else:
                self._dest = memoryview(bytearray(min(self._discard_left, _DISCARD)))
                self._dest_pos = 0
            return
        dest = self._allocate(blen)
        mv = memoryview(dest).cast("B") if isinstance(dest, pa.Buffer) else dest.writable()
        mv[:take] = self._mv[self._lo : self._lo + take]
        self._lo += take
        if take == blen:
            self._pending = None
            self._body_done()
            self._dispatch(frame, dest)
        else:
            self._dest, self._dest_obj, self._dest_pos = mv, dest, take
            self._frame_t0, self._frame_got = self._now(), 0  # (admission may have waited)

    def _arriving(self) -> None:
        """A frame continues past what has arrived: its rate is watched from now (or its start)."""
        if self._frame_t0 is None:
            self._frame_t0, self._frame_got = self._now(), 0

    def _body_filled(self) -> None:
        assert self._dest is not None and self._pending is not None  # (a body was being received)
        if self._reject is not None:
            self._discard_left -= len(self._dest)
            if self._discard_left > 0:
                self._dest = self._dest[: min(self._discard_left, len(self._dest))]
                self._dest_pos = 0
                return
            self._dest = None
            self._finish_reject()
        else:
            frame, _ = self._pending
            dest = self._dest_obj
            self._dest = self._dest_obj = None
            self._pending = None
            self._body_done()
            self._dispatch(frame, dest)
        if not self._admitting:
            self._parse()

    def _body_done(self) -> None:
        done, self.on_body_done = self.on_body_done, None
        if done is not None:
            done()

    def _finish_reject(self) -> None:
        assert self._pending is not None and self._reject is not None  # (a rejected body was read)
        frame, _ = self._pending
        exc, self._reject, self._pending = self._reject, None, None
        for fd in self._frame_fds:
            os.close(fd)
        self._frame_fds = []
        self._rejected(frame, exc)


    # -- its state, for the connection's timers and its end ------------------------------------
    def mid_frame(self) -> bool:
        """Whether a frame has started arriving and is not all in."""
        return self._dest is not None or self._hi > self._lo or self._pending is not None

    def frame_fault(self, now: float) -> DockProtocolError | None:
        """What is wrong with the frame now arriving, if anything: it stalled (no byte for
        `stall_timeout` seconds) or arrives too slowly (`too_slow`). A body held back waits."""
        if not self.mid_frame() or self._admitting:
            return None
        if now - self._last > self.stall_timeout:
            return DockProtocolError(f"a frame stalled: no byte for {self.stall_timeout:g}s")
        t0 = self._frame_t0
        if t0 is not None and too_slow(self._frame_got, now - t0, self.min_rate):
            return DockProtocolError(
                f"a frame arrived at {self._frame_got / (now - t0):.0f} bytes/s for {now - t0:.0f}s, under this "
                f"daemon's minimum of {self.min_rate} bytes/s: the connection is too slow, or holds its room on purpose")
        return None

    def _stop_reading(self) -> None:
        """The connection ended: give back the receive buffer, what was admitted and the descriptors held."""
        self._shrink()
        if self._pending is not None and not self._admitting and self._reject is None and not self._pending[0].reply:
            self._abandoned(*self._pending)  # mid-body: the body's admission is void
            self._pending = None
        self._body_done()
        self._dest = self._dest_obj = None
        for fd in [*self._fds, *self._frame_fds]:
            os.close(fd)
        FrameReader.fds_held -= len(self._fds)
        self._fds.clear()
        self._frame_fds = []
