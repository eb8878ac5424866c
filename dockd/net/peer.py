"""One framed connection inside a daemon's event loop (uvloop where available).

`Peer` reads frames with a BufferedProtocol: small frames are parsed from a
reused scratch buffer; a body goes straight into a freshly allocated Arrow
buffer (the storage it will live in), so a put is received with no extra copy.
A `Handler` decides what to do with requests; replies and requests sent from
this side are matched by frame id. A body may be held back (`Handler.admit`):
reading pauses, which pushes back on the sender through TCP, until the
handler lets it in or rejects it (then the body is read and dropped).

Every connection starts with the handshake of `dockd.net.auth`: an accepted one
(`accept=`) sends a Challenge and takes nothing but an Auth frame until the
peer has proved its role; an outgoing one (`prove=`) answers the daemon's
Challenge. Until then frames are small, bodiless and must arrive within
`handshake_timeout`. Afterwards a frame started must keep arriving (no
`stall_timeout` seconds without a byte inside a frame, and on average at
least `min_rate` bytes a second once it has taken `RATE_GRACE` seconds: one
that averages exactly `min_rate` is received to its end), and a client
connection with no request at all for `idle_timeout` is closed. What an
admitted body holds while it arrives is shared out by who sends it
(`identity`; see `dockd.warehouse.admission`), which `on_body_done` tells when
it is in.

Memory held across connections is bounded too: a header larger than the
scratch buffer is received into memory counted against one budget for the
whole process (`header_budget`); a connection whose header does not fit is
closed with an error saying so, and the others keep their room.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Protocol, cast

import pyarrow as pa

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockAuthError, DockConnectionError, DockError, DockProtocolError, from_status, to_status
from dockd.logutil import Throttle
from dockd.net import auth, wire
from dockd.net.same_host import peer_cred

if TYPE_CHECKING:
    from collections.abc import Callable

    from dockd.net.same_host import UnixTransport

logger = logging.getLogger(__name__)

_SCRATCH = 64 << 10   # per connection; grows for large headers and shrinks back once they are parsed
_DISCARD = 1 << 20
HANDSHAKE_HEADER = 4096       # bytes a frame may have before the peer authenticated
MAX_QUEUED_FDS = 64           # descriptors received ahead of the frames that claim them
_TIMED_MAX = 4096             # requests of one connection timed at once (the rest go untimed)
RATE_GRACE = 10.0             # seconds a frame may take before its average rate is checked
_closing_log = Throttle()     # connections closed for bad input: one line per 10 s, however many
_oneway_log = Throttle()


def too_slow(got: int, elapsed: float, min_rate: int) -> bool:
    """Whether a frame that has taken `elapsed` seconds to bring `got` bytes is cut: once past RATE_GRACE,
    when it averages under `min_rate`. One at exactly `min_rate` is not: it is received to its end."""
    return elapsed > RATE_GRACE and got < min_rate * elapsed


def identity(role: str | None, transport) -> tuple:
    """Who is at the other end of a connection, for sharing what it may hold: (role, "uid", uid) for a process
    of this host (the Unix socket's SO_PEERCRED; the owner of a loopback TCP connection, from /proc/net/tcp),
    else (role, "host", its address). A dock has one token, so over TCP the address tells its clients apart;
    the role tells the daemons (the daemon token) from the clients of the same host or uid."""
    sock = getattr(transport, "sock", None) if getattr(transport, "passes_fds", False) else None
    if sock is not None:
        cred = peer_cred(sock)
        return (role or "", "uid", cred[1]) if cred is not None else (role or "", "host", "unix")
    peer = transport.get_extra_info("peername") if transport is not None else None
    host = str(peer[0] if isinstance(peer, tuple) else peer).removeprefix("::ffff:")
    sock = transport.get_extra_info("socket") if transport is not None else None
    uid = auth.loopback_peer_uid(sock) if sock is not None else None
    return (role or "", "uid", uid) if uid is not None else (role or "", "host", host)


class Handler(Protocol):
    def on_request(self, peer: Peer, frame: pb.Frame, body, fds: list[int]) -> None: ...
    def admit(self, peer: Peer, frame: pb.Frame, body_size: int) -> Awaitable[None] | None: ...
    def allocate(self, size: int):  # -> pa.Buffer or memfd.Segment, the body's destination
        ...
    def on_abandoned(self, peer: Peer, frame: pb.Frame, body_size: int) -> None: ...
    def on_authed(self, peer: Peer) -> None: ...
    def on_lost(self, peer: Peer) -> None: ...


class Peer(asyncio.BufferedProtocol):
    _ids = itertools.count(1)
    # seconds: to authenticate; without a byte inside a frame; without any request (set by the daemon)
    handshake_timeout, stall_timeout, idle_timeout = 10.0, 60.0, 3600.0
    min_rate = 64 << 10          # bytes/s a frame must average once it has taken RATE_GRACE seconds
    fd_budget = 4096             # descriptors all connections may have received ahead of their frames
    fds_held = 0                 # ... held now
    header_budget = 256 << 20    # bytes of grown receive buffers (large headers) all connections may hold
    header_held = 0              # ... held now

    def __init__(self, handler: Handler, *, max_body: int, on_connect=None, accept: auth.ServerAuth | None = None,
                 instance: int = 0, prove=None) -> None:
        self.handler = handler
        self.max_body = max_body
        self.on_connect = on_connect  # called with the transport once connected (e.g. to set socket options)
        self._accept = accept          # accepted connection: what the peer must prove
        self._instance = instance
        self._prove = prove            # outgoing connection: (role, key or callable giving it, session)
        self.role: str | None = None   # the peer's proven role ("client"/"daemon"; "server" for an outgoing one)
        self.session = b""
        self.sid: bytes | None = None  # the session the controller files this connection under (once it used one)
        self.pid: int | None = None    # the peer's process, on a same-host (Unix) connection
        self._challenge: pb.Challenge | None = None
        self._refusing = 0  # the id of the Auth whose check failed: `fail`'s frame answers it
        self.authed: asyncio.Future | None = None  # outgoing: resolves once both sides proved themselves
        self._timer: asyncio.TimerHandle | None = None
        self._last = 0.0  # loop time of the last byte received
        self.parked = 0   # requests of this peer the handler holds (a waiting get): not idle
        self.id = next(Peer._ids)
        self.transport: asyncio.Transport | None = None
        self.name = "?"
        self.closed = False
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
        self._calls: dict[int, asyncio.Future] = {}
        self._next_id = itertools.count(1)
        self._fds: collections.deque[int] = collections.deque()  # received, not yet claimed by a frame
        self._frame_fds: list[int] = []
        self.metrics = getattr(handler, "metrics", None)  # a dockd.node.metrics.Metrics: requests are timed
        self._identity: tuple | None = None
        self.on_body_done: Callable[[], None] | None = None  # called once the admitted body is in (or will not be)
        self._started: dict[int, tuple[str, float]] = {}  # request id -> (kind, arrival), until its reply

    @property
    def identity(self) -> tuple:
        """Who sends on this connection (`identity`), worked out when first asked (after the handshake)."""
        if self._identity is None:
            self._identity = identity(self.role, self.transport)
        return self._identity

    @property
    def passes_fds(self) -> bool:
        """True on a same-host Unix connection that can carry file descriptors."""
        return getattr(self.transport, "passes_fds", False)

    def fds_received(self, fds: list[int]) -> None:
        self._fds.extend(fds)
        Peer.fds_held += len(fds)
        if len(self._fds) > MAX_QUEUED_FDS or self.role is None:
            self.fail(DockProtocolError(f"{len(self._fds)} descriptors sent ahead of the frames that use them"))
        elif Peer.fds_held > Peer.fd_budget:
            self.fail(DockProtocolError(f"this daemon holds {Peer.fds_held} descriptors sent ahead of their frames by "
                                        f"all connections (at most {Peer.fd_budget}); retry"))

    # -- asyncio protocol -----------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.name = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if self.on_connect is not None:
            self.on_connect(transport)
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        if self._accept is not None:
            self._challenge = self._accept.challenge(self._instance)
            self.send(pb.Frame(challenge=self._challenge))
        else:
            self.authed = loop.create_future()
        self._timer = loop.call_later(self.handshake_timeout, self._watchdog)

    def _watchdog(self) -> None:
        """Close connections that never authenticate, stall inside a frame, or sit idle too long."""
        self._timer = None
        if self.closed:
            return
        now = asyncio.get_running_loop().time()
        if self.role is None:
            if self._accept is not None:
                self._accept.failed("timeout")
            self.fail(DockAuthError(f"no authentication within {self.handshake_timeout:g}s"))
            return
        mid_frame = self._dest is not None or self._hi > self._lo or self._pending is not None
        if mid_frame and not self._admitting and now - self._last > self.stall_timeout:
            self.fail(DockProtocolError(f"a frame stalled: no byte for {self.stall_timeout:g}s"))
            return
        t0 = self._frame_t0
        if mid_frame and not self._admitting and t0 is not None and too_slow(self._frame_got, now - t0, self.min_rate):
            self.fail(DockProtocolError(
                f"a frame arrived at {self._frame_got / (now - t0):.0f} bytes/s for {now - t0:.0f}s, under this "
                f"daemon's minimum of {self.min_rate} bytes/s: the connection is too slow, or holds its room on purpose"))
            return
        idle = not mid_frame and not self._calls and not self.parked
        if idle and self.role == auth.CLIENT and now - self._last > self.idle_timeout:
            logger.info("[peer] closing idle connection peer=%s idle=%.0fs", self.name, now - self._last)
            self.close()  # a client reconnects on its next call
            return
        self._timer = asyncio.get_running_loop().call_later(min(self.stall_timeout, self.idle_timeout) / 4, self._watchdog)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._shrink()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.authed is not None and not self.authed.done():
            self.authed.set_exception(DockConnectionError(f"connection to {self.name} closed during authentication"))
        if self._pending is not None and not self._admitting and self._reject is None and not self._pending[0].reply:
            self.handler.on_abandoned(self, *self._pending)  # mid-body: the body's admission is void
            self._pending = None
        self._body_done()
        err = DockConnectionError(f"connection to {self.name} closed" + (f": {exc}" if exc else ""))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()
        self._dest = self._dest_obj = None
        for fd in [*self._fds, *self._frame_fds]:
            os.close(fd)
        Peer.fds_held -= len(self._fds)
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
        self._last = asyncio.get_running_loop().time()
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

    # -- reading --------------------------------------------------------------------
    def _hold(self, size: int) -> None:
        """Count a receive buffer of `size` bytes (what it holds past the scratch size) against
        the process's header budget; refuses (closing this connection) past it."""
        delta = max(size - _SCRATCH, 0) - max(len(self._buf) - _SCRATCH, 0)
        if delta > 0 and Peer.header_held + delta > Peer.header_budget:
            raise DockProtocolError(
                f"this daemon holds {Peer.header_held >> 20} MiB of large request headers from other connections "
                f"(at most {Peer.header_budget >> 20} MiB) and cannot take {delta >> 20} MiB more now; retry, or "
                "split the request")
        Peer.header_held += delta

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

    def _parse(self) -> None:
        while self._pending is None and not self.closed:
            avail = self._hi - self._lo
            if avail < wire.PREFIX.size:
                break
            # an outgoing connection reads replies (larger headers) from a daemon that proved itself
            hlen, blen = wire.parse_prefix(self._buf, self._lo, self.max_body,
                                           wire.MAX_REPLY_HEADER if self._prove is not None else wire.MAX_HEADER)
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
            if frame.reply and blen:
                raise DockProtocolError("a reply to a daemon carries no body")
            if self.metrics is not None and not frame.reply and not frame.oneway and self.role is not None \
                    and len(self._started) < _TIMED_MAX:
                kind = frame.WhichOneof("kind")
                if kind is not None:  # (a bare frame only gives pins back: it has no reply)
                    self._started[frame.id] = (kind, time.perf_counter())
            if frame.fds:
                if frame.fds > len(self._fds):
                    raise DockProtocolError(f"frame announces {frame.fds} descriptors but {len(self._fds)} arrived")
                self._frame_fds = [self._fds.popleft() for _ in range(frame.fds)]
                Peer.fds_held -= frame.fds
            if blen == 0:
                self._dispatch(frame, None)
                continue
            self._pending = (frame, blen)
            wait = None if frame.reply else self.handler.admit(self, frame, blen)
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
        assert self._pending is not None and self.transport is not None  # (the frame admitted; connected)
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
        dest = self.handler.allocate(blen)
        mv = memoryview(dest).cast("B") if isinstance(dest, pa.Buffer) else dest.writable()
        mv[:take] = self._mv[self._lo : self._lo + take]
        self._lo += take
        if take == blen:
            self._pending = None
            self._body_done()
            self._dispatch(frame, dest)
        else:
            self._dest, self._dest_obj, self._dest_pos = mv, dest, take
            self._frame_t0, self._frame_got = asyncio.get_running_loop().time(), 0  # (admission may have waited)

    def _arriving(self) -> None:
        """A frame continues past what has arrived: its rate is watched from now (or its start)."""
        if self._frame_t0 is None:
            self._frame_t0, self._frame_got = asyncio.get_running_loop().time(), 0

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
        self.reply_error(frame, exc)

    def _dispatch(self, frame: pb.Frame, body) -> None:
        fds, self._frame_fds = self._frame_fds, []
        if self.role is None and not (frame.reply and self._accept is None):
            self._handshake(frame)  # (an outgoing connection's replies, the AuthReply among them, go to their calls)
            return
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

    def _handshake(self, frame: pb.Frame) -> None:
        """The first frames of a connection (see dockd.net.auth)."""
        kind = frame.WhichOneof("kind")
        if self._accept is not None:
            if kind != "auth":
                raise DockAuthError(f"authenticate first: got a {kind or 'bare'} frame before the Auth frame")
            try:
                reply = self._accept.verify(self._challenge, frame.auth)
            except DockError:  # `fail` answers the Auth itself, so the peer's call learns why
                self._refusing = frame.id
                raise
            self.role, self.session = frame.auth.role, bytes(frame.auth.session)
            self.handler.on_authed(self)
            self.reply(frame, pb.Frame(auth_reply=reply))
            return
        if kind != "challenge" or self._challenge is not None:
            raise DockProtocolError(f"expected the daemon's challenge, got a {kind or 'bare'} frame")
        self._challenge = frame.challenge
        role, key, session = self._prove
        key = key() if callable(key) else key
        a = auth.answer(frame.challenge, role, key, session=session)
        self.request(pb.Frame(auth=a)).add_done_callback(lambda f: self._authed(f, a, key))

    def _authed(self, f: asyncio.Future, a: pb.Auth, key: bytes | None) -> None:
        assert self.authed is not None  # (an outgoing connection: made in connection_made)
        if self.authed.done():
            if not f.cancelled():
                f.exception()  # (retrieved: the connection's end already failed the handshake)
            return
        try:
            reply, _ = f.result()
            auth.check_reply(self._challenge, a, reply.auth_reply, key, self.name)
        except Exception as e:
            self.authed.set_exception(e)
            self.close()
            return
        self.role = "server"
        self.authed.set_result(None)

    # -- writing --------------------------------------------------------------------
    def send(self, frame: pb.Frame, buffers: Sequence = (), body_size: int = 0, fds: Sequence = (),
             tail: bytes = b"") -> None:
        """Write a frame; fds (ints or objects with fileno(), kept alive until written) need a Unix transport.
        `tail`: a serialized Frame the peer's parse merges into this one (see `wire.header`)."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        if fds:
            frame.fds = len(fds)
            # (descriptors go only over a connection that passes them: a same_host.UnixTransport)
            cast("UnixTransport", self.transport).writelines([wire.header(frame, body_size, tail), *buffers], fds)
        else:
            self.transport.writelines([wire.header(frame, body_size, tail), *buffers])

    def reply(self, request: pb.Frame, frame: pb.Frame, buffers: Sequence = (), body_size: int = 0, fds: Sequence = (),
              *, tail: bytes = b"") -> None:
        if request.oneway:
            return
        frame.id = request.id
        frame.reply = True
        self.send(frame, buffers, body_size, fds, tail)
        if self._started and self.metrics is not None:  # (requests are timed only with metrics)
            started = self._started.pop(request.id, None)
            if started is not None:
                self.metrics.request(started[0], time.perf_counter() - started[1])

    def reply_error(self, request: pb.Frame, exc: BaseException) -> None:
        if request.oneway:
            _oneway_log.log(logger, logging.WARNING, "[peer] one-way request failed peer=%s error=%s", self.name, exc)
            return
        if self.metrics is not None and self.role is not None:
            self.metrics.error(request.WhichOneof("kind") or "unpin", exc)
        frame = pb.Frame()
        to_status(exc, frame.status)
        self.reply(request, frame)

    def request(self, frame: pb.Frame, buffers: Sequence = (), body_size: int = 0) -> asyncio.Future:
        """Send a request (with a body of `buffers`, `body_size` bytes); the future resolves to
        (reply frame, body) or raises the mapped error."""
        fut = asyncio.get_running_loop().create_future()
        if self.closed:
            fut.set_exception(DockConnectionError(f"connection to {self.name} is closed"))
            return fut
        frame.id = next(self._next_id)
        self._calls[frame.id] = fut
        self.send(frame, buffers, body_size)
        return fut

    def fail(self, exc: BaseException) -> None:
        """A protocol violation: tell the peer once, then hang up."""
        _closing_log.log(logger, logging.WARNING, "[peer] closing connection peer=%s reason=%s", self.name, exc)
        frame = pb.Frame(reply=True, id=self._refusing)
        to_status(exc, frame.status)
        self.send(frame)
        self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self.closed = True
