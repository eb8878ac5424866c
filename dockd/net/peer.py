"""One framed connection inside a daemon's event loop (uvloop where available).

`Peer` reads frames as its base `dockd.net.frame_reader.FrameReader` does: small
frames parsed from a reused scratch buffer, each body straight into the storage
it will live in (`Handler.allocate`), held back while `Handler.admit` waits
(reading pauses, which pushes back on the sender through TCP). A `Handler`
decides what to do with requests; replies and requests sent from this side are
matched by frame id.

Every connection starts with the handshake of `dockd.net.auth`: an accepted one
(`accept=`) sends a Challenge and takes nothing but an Auth frame until the
peer has proved its role; an outgoing one (`prove=`) answers the daemon's
Challenge. Until then frames are small, bodiless and must arrive within
`handshake_timeout`. Afterwards a frame started must keep arriving (no
`stall_timeout` seconds without a byte inside a frame, and on average at
least `min_rate` bytes a second once it has taken `RATE_GRACE` seconds:
`FrameReader.frame_fault`), and a client connection with no request at all
for `idle_timeout` is closed. What an admitted body holds while it arrives is
shared out by who sends it (`identity`; see `dockd.warehouse.admission`),
which `on_body_done` tells when it is in. Memory and descriptors held across
connections are bounded as `FrameReader` says.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, cast

from mypy_extensions import mypyc_attr

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockAuthError, DockConnectionError, DockError, DockProtocolError, from_status, to_status
from dockd.logutil import Throttle
from dockd.net import auth, wire
from dockd.net.frame_reader import FrameReader
from dockd.net.same_host import peer_cred

if TYPE_CHECKING:
    from dockd.net.same_host import UnixTransport

logger = logging.getLogger(__name__)

_closing_log = Throttle()     # connections closed for bad input: one line per 10 s, however many
_oneway_log = Throttle()


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


@mypyc_attr(allow_interpreted_subclasses=True)  # (compiled, it may still be subclassed in Python: the tests do)
class Peer(FrameReader):
    _ids: ClassVar[itertools.count[int]] = itertools.count(1)
    # seconds: to authenticate; without a byte inside a frame; without any request (set by the daemon)
    handshake_timeout: ClassVar[float] = 10.0
    stall_timeout: ClassVar[float] = 60.0
    idle_timeout: ClassVar[float] = 3600.0

    def __init__(self, handler: Handler, *, max_body: int, on_connect=None, accept: auth.ServerAuth | None = None,
                 instance: int = 0, prove=None) -> None:
        # an outgoing connection reads replies (larger headers) from a daemon that proved itself
        super().__init__(max_body=max_body, max_header=wire.MAX_REPLY_HEADER if prove is not None else wire.MAX_HEADER,
                         metrics=getattr(handler, "metrics", None))
        self.handler = handler
        self.on_connect = on_connect  # called with the transport once connected (e.g. to set socket options)
        self._accept = accept          # accepted connection: what the peer must prove
        self._instance = instance
        self._prove = prove            # outgoing connection: (role, key or callable giving it, session)
        # role: the peer's proven role ("client"/"daemon"; "server" for an outgoing one)
        self.session = b""
        self.sid: bytes | None = None  # the session the controller files this connection under (once it used one)
        self.pid: int | None = None    # the peer's process, on a same-host (Unix) connection
        self._challenge: pb.Challenge | None = None
        self._refusing = 0  # the id of the Auth whose check failed: `fail`'s frame answers it
        self.authed: asyncio.Future | None = None  # outgoing: resolves once both sides proved themselves
        self._timer: asyncio.TimerHandle | None = None
        self.parked = 0   # requests of this peer the handler holds (a waiting get): not idle
        self.id = next(Peer._ids)
        self._calls: dict[int, asyncio.Future] = {}
        self._next_id = itertools.count(1)
        self._identity: tuple | None = None

    @property
    def identity(self) -> tuple:
        """Who sends on this connection (`identity`), worked out when first asked (after the handshake)."""
        if self._identity is None:
            self._identity = identity(self.role, self.transport)
        return self._identity

    @property
    def challenge(self) -> pb.Challenge | None:
        """The daemon's challenge of this connection: the one it sent (accepted) or got (outgoing)."""
        return self._challenge

    @property
    def passes_fds(self) -> bool:
        """True on a same-host Unix connection that can carry file descriptors."""
        return getattr(self.transport, "passes_fds", False)

    # -- asyncio protocol -----------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.name = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if self.on_connect is not None:
            self.on_connect(transport)
        loop = self._loop = asyncio.get_running_loop()
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
        fault = self.frame_fault(now)
        if fault is not None:
            self.fail(fault)
            return
        idle = not self.mid_frame() and not self._calls and not self.parked
        if idle and self.role == auth.CLIENT and now - self._last > self.idle_timeout:
            logger.info("[peer] closing idle connection peer=%s idle=%.0fs", self.name, now - self._last)
            self.close()  # a client reconnects on its next call
            return
        self._timer = asyncio.get_running_loop().call_later(min(self.stall_timeout, self.idle_timeout) / 4, self._watchdog)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.authed is not None and not self.authed.done():
            self.authed.set_exception(DockConnectionError(f"connection to {self.name} closed during authentication"))
        self._stop_reading()
        err = DockConnectionError(f"connection to {self.name} closed" + (f": {exc}" if exc else ""))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()
        try:
            self.handler.on_lost(self)
        except Exception:
            logger.exception("[peer] on_lost handler failed peer=%s", self.name)

    # -- frames read ----------------------------------------------------------------------
    def _admit(self, frame: pb.Frame, body_size: int) -> Awaitable[None] | None:
        return self.handler.admit(self, frame, body_size)

    def _allocate(self, size: int):
        return self.handler.allocate(size)

    def _abandoned(self, frame: pb.Frame, body_size: int) -> None:
        self.handler.on_abandoned(self, frame, body_size)

    def _rejected(self, frame: pb.Frame, exc: BaseException) -> None:
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
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            return
        if fds:
            frame.fds = len(fds)
            # (descriptors go only over a connection that passes them: a same_host.UnixTransport)
            cast("UnixTransport", transport).writelines([wire.header(frame, body_size, tail), *buffers], fds)
        else:
            transport.writelines([wire.header(frame, body_size, tail), *buffers])

    def reply(self, request: pb.Frame, frame: pb.Frame, buffers: Sequence = (), body_size: int = 0, fds: Sequence = (),
              *, tail: bytes = b"") -> None:
        if request.oneway:
            return
        frame.id = rid = request.id
        frame.reply = True
        self.send(frame, buffers, body_size, fds, tail)
        if self._started and self.metrics is not None:  # (requests are timed only with metrics)
            started = self._started.pop(rid, None)
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
