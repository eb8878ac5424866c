"""One framed connection inside a daemon's event loop (uvloop where available).

`Peer` reads frames with a BufferedProtocol: small frames are parsed from a
reused scratch buffer; a body goes straight into a freshly allocated Arrow
buffer (the storage it will live in), so a put is received with no extra copy.
A `Handler` decides what to do with requests; replies and requests sent from
this side are matched by frame id. A body may be held back (`Handler.admit`):
reading pauses, which pushes back on the sender through TCP, until the
handler lets it in or rejects it (then the body is read and dropped).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
from collections.abc import Awaitable, Sequence
from typing import Protocol

import pyarrow as pa

from dockd import wire
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError, DockError, DockProtocolError, from_status, to_status

logger = logging.getLogger(__name__)

_SCRATCH = 256 << 10
_DISCARD = 1 << 20


class Handler(Protocol):
    def on_request(self, peer: Peer, frame: pb.Frame, body, fds: list[int]) -> None: ...
    def admit(self, peer: Peer, frame: pb.Frame, body_size: int) -> Awaitable[None] | None: ...
    def allocate(self, size: int):  # -> pa.Buffer or shm.Segment, the body's destination
        ...
    def on_abandoned(self, peer: Peer, frame: pb.Frame, body_size: int) -> None: ...
    def on_lost(self, peer: Peer) -> None: ...


class Peer(asyncio.BufferedProtocol):
    _ids = itertools.count(1)

    def __init__(self, handler: Handler, *, max_body: int, on_connect=None) -> None:
        self.handler = handler
        self.max_body = max_body
        self.on_connect = on_connect  # called with the transport once connected (e.g. to set socket options)
        self.id = next(Peer._ids)
        self.transport: asyncio.Transport | None = None
        self.name = "?"
        self.closed = False
        self._buf = bytearray(_SCRATCH)
        self._mv = memoryview(self._buf)
        self._lo = self._hi = 0
        self._pending: tuple[pb.Frame, int] | None = None  # frame whose body is next
        self._admitting = False
        self._dest: memoryview | None = None
        self._dest_obj: pa.Buffer | None = None
        self._dest_pos = 0
        self._discard_left = 0
        self._reject: BaseException | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._next_id = itertools.count(1)
        self._fds: collections.deque[int] = collections.deque()  # received, not yet claimed by a frame
        self._frame_fds: list[int] = []

    @property
    def passes_fds(self) -> bool:
        """True on a same-host Unix connection that can carry file descriptors."""
        return getattr(self.transport, "passes_fds", False)

    def fds_received(self, fds: list[int]) -> None:
        self._fds.extend(fds)

    # -- asyncio protocol -----------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.name = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if self.on_connect is not None:
            self.on_connect(transport)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._pending is not None and not self._admitting and self._reject is None and not self._pending[0].reply:
            self.handler.on_abandoned(self, *self._pending)  # mid-body: the body's admission is void
            self._pending = None
        err = DockConnectionError(f"connection to {self.name} closed" + (f": {exc}" if exc else ""))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()
        self._dest = self._dest_obj = None
        for fd in [*self._fds, *self._frame_fds]:
            os.close(fd)
        self._fds.clear()
        self._frame_fds = []
        try:
            self.handler.on_lost(self)
        except Exception:
            logger.exception("[peer] on_lost handler failed peer=%s", self.name)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._dest is not None:
            return self._dest[self._dest_pos :]
        if self._hi == len(self._buf):
            self._compact(len(self._buf) * 2 if self._lo == 0 else 0)
        return self._mv[self._hi :]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._dest is not None:
                self._dest_pos += nbytes
                if self._dest_pos == len(self._dest):
                    self._body_filled()
                return
            self._hi += nbytes
            self._parse()
        except DockProtocolError as e:
            self.fail(e)
        except Exception as e:  # a bug must not take the daemon down: drop this connection only
            logger.exception("[peer] failed to handle input peer=%s", self.name)
            self.fail(DockProtocolError(f"internal error while reading a frame: {e}"))

    def eof_received(self) -> bool:
        return False

    # -- reading --------------------------------------------------------------------
    def _compact(self, grow: int = 0) -> None:
        live = self._hi - self._lo
        if grow:
            new = bytearray(max(grow, live))
            new[:live] = self._mv[self._lo : self._hi]
            self._buf, self._mv = new, memoryview(new)
        else:
            self._mv[:live] = self._mv[self._lo : self._hi]
        self._lo, self._hi = 0, live

    def _parse(self) -> None:
        while self._pending is None and not self.closed:
            avail = self._hi - self._lo
            if avail < wire.PREFIX.size:
                break
            hlen, blen = wire.parse_prefix(self._buf, self._lo, self.max_body)
            need = wire.PREFIX.size + hlen
            if avail < need:
                if need > len(self._buf) - self._lo:
                    self._compact(grow=max(need, len(self._buf)))
                break
            start = self._lo + wire.PREFIX.size
            frame = wire.parse_header(self._mv[start : start + hlen])
            self._lo += need
            if frame.fds:
                if frame.fds > len(self._fds):
                    raise DockProtocolError(f"frame announces {frame.fds} descriptors but {len(self._fds)} arrived")
                self._frame_fds = [self._fds.popleft() for _ in range(frame.fds)]
            if blen == 0:
                self._dispatch(frame, None)
                continue
            self._pending = (frame, blen)
            wait = None if frame.reply else self.handler.admit(self, frame, blen)
            if wait is not None:
                self._admitting = True
                self.transport.pause_reading()
                asyncio.ensure_future(wait).add_done_callback(self._admitted)
                return
            self._start_body()
        if self._lo == self._hi:
            self._lo = self._hi = 0

    def _admitted(self, fut: asyncio.Future) -> None:
        self._admitting = False
        if self.closed:
            if not fut.cancelled() and fut.exception() is None:
                self.handler.on_abandoned(self, *self._pending)
            self._pending = None
            return
        self._reject = fut.exception() if not fut.cancelled() else DockError("admission cancelled")
        self._start_body()
        self.transport.resume_reading()
        if self._dest is None and self._pending is None:
            self._parse()

    def _start_body(self) -> None:
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
        dest = self.handler.allocate(blen)
        mv = memoryview(dest).cast("B") if isinstance(dest, pa.Buffer) else dest.writable()
        mv[:take] = self._mv[self._lo : self._lo + take]
        self._lo += take
        if take == blen:
            self._pending = None
            self._dispatch(frame, dest)
        else:
            self._dest, self._dest_obj, self._dest_pos = mv, dest, take

    def _body_filled(self) -> None:
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
            self._dispatch(frame, dest)
        if not self._admitting:
            self._parse()

    def _finish_reject(self) -> None:
        frame, _ = self._pending
        exc, self._reject, self._pending = self._reject, None, None
        for fd in self._frame_fds:
            os.close(fd)
        self._frame_fds = []
        self.reply_error(frame, exc)

    def _dispatch(self, frame: pb.Frame, body) -> None:
        fds, self._frame_fds = self._frame_fds, []
        if frame.reply:
            for fd in fds:
                os.close(fd)
            fut = self._calls.pop(frame.id, None)
            if fut is not None and not fut.done():
                if frame.status.code != pb.OK:
                    fut.set_exception(from_status(frame.status))
                else:
                    fut.set_result((frame, body))
            return
        try:
            self.handler.on_request(self, frame, body, fds)
        except Exception as e:  # handlers raise DockError for bad input; anything else is a bug
            if not isinstance(e, (DockError, ValueError, TypeError)):
                logger.exception("[peer] handler failed peer=%s kind=%s", self.name, frame.WhichOneof("kind"))
            self.reply_error(frame, e)

    # -- writing --------------------------------------------------------------------
    def send(self, frame: pb.Frame, buffers: Sequence = (), body_size: int = 0, fds: Sequence = ()) -> None:
        """Write a frame; fds (ints or objects with fileno(), kept alive until written) need a Unix transport."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        if fds:
            frame.fds = len(fds)
            self.transport.writelines([wire.header(frame, body_size), *buffers], fds)
        else:
            self.transport.writelines([wire.header(frame, body_size), *buffers])

    def reply(self, request: pb.Frame, frame: pb.Frame, buffers: Sequence = (), body_size: int = 0, fds: Sequence = ()) -> None:
        if request.oneway:
            return
        frame.id = request.id
        frame.reply = True
        self.send(frame, buffers, body_size, fds)

    def reply_error(self, request: pb.Frame, exc: BaseException) -> None:
        if request.oneway:
            logger.warning("[peer] one-way request failed peer=%s error=%s", self.name, exc)
            return
        frame = pb.Frame()
        to_status(exc, frame.status)
        self.reply(request, frame)

    def request(self, frame: pb.Frame) -> asyncio.Future:
        """Send a request; the future resolves to (reply frame, body) or raises the mapped error."""
        fut = asyncio.get_running_loop().create_future()
        if self.closed:
            fut.set_exception(DockConnectionError(f"connection to {self.name} is closed"))
            return fut
        frame.id = next(self._next_id)
        self._calls[frame.id] = fut
        self.send(frame)
        return fut

    def fail(self, exc: BaseException) -> None:
        """A protocol violation: tell the peer once, then hang up."""
        logger.warning("[peer] closing connection peer=%s reason=%s", self.name, exc)
        frame = pb.Frame(reply=True)
        to_status(exc, frame.status)
        self.send(frame)
        self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self.closed = True
