"""A daemon's connections to other daemons (a warehouse's to its controllers, to the warehouse it copies a
put or relays weights to; a controller's probe of the others): TCP with keepalive (`keepalive`), then TLS
when the far daemon's first frame is the TLS preamble (`open_link`, see dockd.net.tls)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockProtocolError
from dockd.net import tls, wire
from dockd.net.peer import Peer

logger = logging.getLogger(__name__)

KEEPALIVE = (5, 2, 3)  # idle seconds, interval seconds, probes: a dead peer is noticed in ~11 s


def keepalive(transport) -> None:
    """TCP keepalive on a connection, so a vanished host is noticed without traffic."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            idle, interval, count = KEEPALIVE
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
    except OSError as e:
        logger.debug("[link] cannot set TCP keepalive: %s", e)


async def open_link(make_peer: Callable[[], Peer], host: str, port: int,
                    link_tls: tls.LinkTls | None) -> tuple[asyncio.BaseTransport, Peer]:
    """Connect a daemon-to-daemon link: TCP, then, when the far daemon's first frame is the TLS
    preamble (dockd.net.tls), TLS checked with `link_tls`. A mismatch either way raises DockAuthError."""
    loop = asyncio.get_running_loop()
    address = f"{host}:{port}"
    sock: socket.socket | None = None
    last: OSError = OSError(f"cannot resolve {host}")
    for family, kind, proto, _, addr in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
            break
        except OSError as e:
            sock.close()
            sock, last = None, e
    if sock is None:
        raise last
    try:
        frame, size = await _peek_frame(sock)
        if not tls.is_preamble(frame):
            if link_tls is not None:
                raise tls.not_tls(address, "this warehouse (--tls-cert)")
            transport, peer = await loop.create_connection(make_peer, sock=sock)
            return transport, peer
        if link_tls is None:
            raise tls.needs_tls(address, "this warehouse")
        if len(sock.recv(size)) != size:  # the preamble, read whole by the peek above
            raise DockProtocolError(f"{address} cut its TLS preamble short")
        made: list[Peer] = []

        def factory() -> Peer:
            made.append(make_peer())
            return made[-1]

        try:
            transport, peer = await loop.create_connection(factory, sock=sock, ssl=link_tls.context,
                                                           server_hostname=host, ssl_handshake_timeout=5.0)
        except BaseException as e:
            for p in made:  # made, never connected: let the daemon forget it
                p.connection_lost(e if isinstance(e, Exception) else None)
            if isinstance(e, ssl.SSLCertVerificationError):
                raise tls.untrusted(address, link_tls.ca, e) from None
            raise
        return transport, peer
    except BaseException:
        sock.close()
        raise


async def _peek_frame(sock: socket.socket, limit: int = 4096) -> tuple[pb.Frame, int]:
    """The first frame the far daemon sent (a challenge or the TLS preamble), left unread; and its size."""
    loop = asyncio.get_running_loop()
    want = wire.PREFIX.size
    while True:
        try:
            data: bytes | None = sock.recv(want, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            data = None
        if data == b"":
            raise ConnectionResetError("the daemon closed the connection before its challenge")
        if data is not None and len(data) >= want:
            if want == wire.PREFIX.size:
                hlen, _ = wire.parse_prefix(data, 0, 0, limit)
                want += hlen
                continue
            return wire.parse_header(data[wire.PREFIX.size : want]), want
        # wait until `want` bytes are there (or the connection ends): the socket reads as readable only
        # then (SO_RCVLOWAT; a part of the frame that arrived already would otherwise wake us at once)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(sock.fileno(), _wake, readable)
        try:
            await readable
        finally:
            loop.remove_reader(sock.fileno())
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
