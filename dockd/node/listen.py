"""Where a daemon's connections come from, and who may keep them.

`Listeners` owns the framed TCP port, the same-host Unix socket (frames plus
memfd descriptors; the one place that tells the two transports apart on the
serving side, apart from `Peer.passes_fds`), the connections they accepted,
and the checks made before a connection may send anything: who the peer is
(its uid on a Unix or tokenless loopback connection), how many connections are
open, and the descriptor budget shared by connections, descriptors in flight
and stored segments. Authentication itself is the handshake each `Peer` runs
with `server_auth` (see `dockd.net.auth`); the keys it checks are chosen by
`Keys`.

With `--tls-cert` the TCP port speaks TLS: each connection gets the plain TLS preamble
(`dockd.net.tls`), then the TLS handshake, and only then its `Peer` (so the dockd handshake
and every frame run inside TLS); the Unix socket never leaves the host and has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import secrets
import socket
import ssl
from collections.abc import Callable
from pathlib import Path

from dockd import config, owners
from dockd._proto import dockd_pb2 as pb
from dockd.config import NodeConfig
from dockd.logutil import Throttle
from dockd.net import auth, memfd, same_host, tls, wire
from dockd.net.peer import Handler, Peer
from dockd.node.dial import keepalive

logger = logging.getLogger(__name__)
_refusals = Throttle()  # connections refused (limits, other users): one line per 10 s


class Keys:
    """The keys a daemon checks and proves.

    The daemon role is never proven with the clients' token: every client holds that one. It
    takes the daemon token (--daemon-token-file), else a per-dock secret that only the dock's
    own daemons hold (handed down by start_local, or written by the controller to a file of
    its user's that warehouses on its host read). Only --insecure without a token has no roles."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.token = auth.load_token(cfg.token_file) if cfg.token_file else None
        daemon = auth.load_token(cfg.daemon_token_file, "daemon token") if cfg.daemon_token_file else None
        if daemon is None and not self.no_roles:
            secret = config.env("DOCKD_DAEMON_SECRET")
            if secret:
                daemon = bytes.fromhex(secret)
            elif cfg.controller and len(cfg.controllers) > 1:  # several controllers: one secret for all of them
                daemon = auth.controllers_secret(cfg.controllers)
            elif cfg.controller:
                daemon = secrets.token_bytes(32)
        self.daemon = daemon  # a joining warehouse without one reads its controller's secret file
        self.server_auth = auth.ServerAuth(client_key=self.token, daemon_key=daemon)
        self._secret_file: Path | None = None
        self._no_daemon_key_warned = False

    @property
    def no_roles(self) -> bool:
        return self.cfg.insecure and self.token is None

    def publish(self, port: int) -> None:
        """A controller's own secret goes to a file of its user's: warehouses started by hand on this
        host prove the daemon role with it."""
        if self.cfg.controller and self.daemon is not None and not self.cfg.daemon_token_file \
                and not config.env("DOCKD_DAEMON_SECRET"):
            self._secret_file = auth.write_daemon_secret(port, self.daemon)

    def unpublish(self) -> None:
        if self._secret_file is not None:
            self._secret_file.unlink(missing_ok=True)

    def link_key(self):
        """What this warehouse proves to its controller: a key, or a callable that finds one."""
        return self.daemon if self.daemon is not None or self.no_roles else self._controller_secret

    def _controller_secret(self) -> bytes | None:
        """The daemon secret of a controller on this host (None, said once, when there is none)."""
        key = next((k for a in self.cfg.join_addresses if (k := auth.read_daemon_secret(int(a.rpartition(":")[2])))),
                   None)
        if key is not None:
            self.server_auth.daemon_key = key  # and this daemon asks the same of whoever claims the role
        elif not self._no_daemon_key_warned:
            self._no_daemon_key_warned = True
            logger.error(
                "[auth] this warehouse has no daemon token to prove to the controller at %s: give it "
                "--daemon-token-file FILE, the file the controller was started with (clients never get it). The "
                "dock's token alone does not make a daemon; only a warehouse on the controller's own host finds the "
                "controller's secret by itself%s", self.cfg.join,
                "" if not all(owners.is_loopback(a.rpartition(":")[0]) for a in self.cfg.join_addresses) else
                "; and no controller of this user listens on this host at that port: is it a warehouse's? --join "
                "names the controller's HOST:PORT")
        return key


class Listeners:
    """The daemon's listening sockets and the connections they (and the controller link) opened.

    Args:
        handler: what every connection hands its requests to.
        on_unix_peer: called with a same-host peer's process id once its connection is accepted.
    """

    def __init__(self, cfg: NodeConfig, keys: Keys, handler: Handler, instance: int,
                 on_unix_peer: Callable[[int | None], None]) -> None:
        self.cfg = cfg
        self.keys = keys
        self.handler = handler
        self.instance = instance
        self.on_unix_peer = on_unix_peer
        self.peers: set[Peer] = set()
        self.port = 0
        self.unix_name = ""
        self.max_connections = cfg.max_connections
        self._server: asyncio.base_events.Server | None = None
        self._unix: socket.socket | None = None
        self._accept_delay = 0.0  # backoff of the same-host accept loop while descriptors run out
        self._stopped = False
        # TLS (--tls-cert): what the TCP port serves with, and what this daemon checks the daemons it
        # connects to (its controller) with: --tls-ca, else its own certificate (one cluster certificate)
        self.tls_server: ssl.SSLContext | None = None
        self.link_tls: tls.LinkTls | None = None
        if cfg.tls_cert:
            self.tls_server = tls.server_context(cfg.tls_cert, cfg.tls_key)
            ca = cfg.tls_ca or cfg.tls_cert
            self.link_tls = tls.LinkTls(tls.client_context(ca), ca)
        self._starting: set[_TlsStart] = set()
        Peer.handshake_timeout, Peer.stall_timeout = cfg.handshake_timeout, cfg.stall_timeout
        Peer.min_rate = cfg.min_rate
        Peer.idle_timeout = cfg.idle_timeout

    @property
    def same_host(self) -> bool:
        """Whether same-host clients connect over the Unix socket (and pass descriptors)."""
        return self._unix is not None

    async def listen_tcp(self) -> None:
        loop = asyncio.get_running_loop()
        factory = self.make_peer if self.tls_server is None else self._tls_start
        try:
            self._server = await loop.create_server(factory, self.cfg.host, self.cfg.port, reuse_address=True)
        except OSError as e:
            raise bind_error(self.cfg.host, self.cfg.port, "--port", "the framed port clients connect to", e) from None
        self.port = self._server.sockets[0].getsockname()[1]

    def listen_unix(self) -> None:
        """Same-host clients: frames on an abstract Unix socket, payloads as memfd descriptors."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = same_host.unix_name(self.port)
        sock.bind(same_host.unix_address(name))
        sock.listen(128)
        sock.setblocking(False)
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept_unix)
        self._unix, self.unix_name = sock, name
        if memfd.huge_pages_state() in ("never", "deny"):
            logger.info(
                "[shm] transparent huge pages are off for shared memory: large same-host puts and first reads "
                "run several times slower. To enable (as root): "
                "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled"
            )

    def budget_descriptors(self) -> None:
        """Share the descriptor limit (raised to the hard limit) among connections (a quarter),
        descriptors in flight on them (an eighth) and stored segments (`memfd.segment_budget`), so
        that no use of one starves the others."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:  # every shared-memory put body holds one descriptor
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        self.max_connections = min(self.cfg.max_connections, max(8, soft // 4))
        Peer.fd_budget = max(64, soft // 8)
        if self.max_connections < self.cfg.max_connections:
            logger.info("[node] at most %d connections: a quarter of the descriptor limit (%d); raise it "
                        "(ulimit -n, LimitNOFILE=) for the %d of --max-connections", self.max_connections, soft,
                        self.cfg.max_connections)

    def _accept_unix(self) -> None:
        sock = self._unix
        assert sock is not None  # (the reader of the socket listen_unix made)
        while True:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors or memory: pause accepting instead of spinning on it
                self._accept_delay = min(max(2 * self._accept_delay, 0.05), 1.0)
                _refusals.log(logger, logging.WARNING, "[node] same-host accept failed (%s); accepting again in %.2fs",
                              e, self._accept_delay)
                loop = asyncio.get_running_loop()
                loop.remove_reader(sock.fileno())
                loop.call_later(self._accept_delay, self._resume_accept)
                return
            self._accept_delay = 0.0
            pid, uid = same_host.peer_cred(conn) or (None, None)
            if uid not in (os.getuid(), 0):  # the abstract socket has no permissions of its own
                self.keys.server_auth.failed("uid")
                _refusals.log(logger, logging.WARNING,
                              "[auth] refused a same-host connection from uid=%s (this daemon runs as uid=%d)",
                              uid, os.getuid())
                if self.keys.token is None:  # (with a token, other users are served over TCP: a bare close
                    with contextlib.suppress(OSError):  # makes their client go there without a word)
                        conn.send(other_user(uid))
                conn.close()
                continue
            peer = self.make_peer()
            peer.pid = pid  # who pins the segments lent on this connection
            self.on_unix_peer(pid)
            same_host.UnixTransport(asyncio.get_running_loop(), conn, peer)

    def _resume_accept(self) -> None:
        if self._unix is not None and not self._stopped:
            asyncio.get_running_loop().add_reader(self._unix.fileno(), self._accept_unix)

    def make_peer(self) -> Peer:
        """An accepted connection: it must authenticate first."""
        peer = Peer(self.handler, max_body=self.cfg.max_frame, on_connect=self._connected,
                    accept=self.keys.server_auth, instance=self.instance)
        self.peers.add(peer)
        return peer

    def make_link_peer(self) -> Peer:
        """This warehouse's connection to its controller: it proves the daemon role (over TLS when
        `link_tls` is set: dockd.node.dial.open_link finds it here)."""
        peer = Peer(self.handler, max_body=self.cfg.max_frame, on_connect=keepalive,
                    prove=(auth.DAEMON, self.keys.link_key(), b""))
        self.peers.add(peer)
        return peer

    def make_probe_peer(self) -> Peer:
        """A connection as a client of the dock (its token), to ask another controller for its list."""
        peer = Peer(self.handler, max_body=self.cfg.max_frame, prove=(auth.CLIENT, self.keys.token, b""))
        self.peers.add(peer)
        return peer

    def _tls_start(self) -> _TlsStart:
        return _TlsStart(self)

    def _connected(self, transport) -> None:
        keepalive(transport)
        if self.keys.token is None:  # tokenless: loopback TCP is as private as the same-host socket
            sock = transport.get_extra_info("socket")
            uid = auth.loopback_peer_uid(sock) if sock is not None and sock.family != socket.AF_UNIX else None
            if uid is not None and uid not in (os.getuid(), 0):
                self.keys.server_auth.failed("uid")
                _refusals.log(logger, logging.WARNING,
                              "[auth] refused a loopback connection from uid=%s: this dock has no token, so only its "
                              "own user (uid=%d) may use it; give the dock a token (--token-file) to share it",
                              uid, os.getuid())
                transport.write(other_user(uid))
                transport.close()
                return
        if len(self.peers) > self.max_connections:
            _refusals.log(logger, logging.WARNING,
                          "[node] refusing a connection: %d open, the limit is %d (--max-connections, and a quarter "
                          "of the descriptor limit)", len(self.peers) - 1, self.max_connections)
            transport.close()

    def lost(self, peer: Peer) -> None:
        self.peers.discard(peer)

    def close(self) -> None:
        """Stop accepting (the Unix socket first) and hang up every connection."""
        self._stopped = True
        if self._unix is not None:
            asyncio.get_running_loop().remove_reader(self._unix.fileno())
            self._unix.close()
        if self._server is not None:
            self._server.close()
        for start in list(self._starting):
            start.abort()
        for peer in list(self.peers):
            peer.close()

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_closed()


class _TlsStart(asyncio.Protocol):
    """A TCP connection to a TLS daemon until its TLS handshake is done: sends the preamble, runs the
    handshake (within --handshake-timeout) and hands the TLS transport to a new Peer.

    The preamble goes out only once start_tls has taken the connection over: the client sends its
    TLS hello after reading it, and nothing must read that hello but TLS (uvloop starts reading a
    new connection whatever connection_made did)."""

    def __init__(self, owner: Listeners) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.owner._starting.add(self)
        self.task = asyncio.ensure_future(self._upgrade())

    async def _upgrade(self) -> None:
        owner, transport = self.owner, self.transport
        assert transport is not None and owner.tls_server is not None
        loop = asyncio.get_running_loop()
        try:
            handshake = asyncio.ensure_future(loop.start_tls(
                transport, self, owner.tls_server, server_side=True, ssl_handshake_timeout=owner.cfg.handshake_timeout))
            while transport.get_protocol() is self and not handshake.done():
                await asyncio.sleep(0)  # (start_tls puts its protocol in place at its first step)
            if not handshake.done():
                transport.write(tls.preamble(owner.instance, owner.unix_name))
            secure = await handshake
        except (OSError, asyncio.TimeoutError, ConnectionError) as e:
            owner._starting.discard(self)
            # a client without TLS reads the preamble and hangs up (it raises the clear error itself)
            _refusals.log(logger, logging.INFO, "[auth] TLS handshake with %s failed: %s",
                          transport.get_extra_info("peername"), e or type(e).__name__)
            transport.abort()
            return
        owner._starting.discard(self)
        if secure is None or owner._stopped:
            transport.abort()
            return
        peer = owner.make_peer()
        secure.set_protocol(peer)
        peer.connection_made(secure)

    def data_received(self, data: bytes) -> None:
        pass  # (nothing comes before the preamble, which goes out once start_tls reads the connection)

    def connection_lost(self, exc) -> None:
        self.owner._starting.discard(self)

    def abort(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.transport is not None:
            self.transport.abort()


def other_user(uid: int | None) -> bytes:
    """The one frame a tokenless daemon sends another user's connection before it closes it (in place
    of its challenge): why, and what to do. The client raises it as DockAuthError."""
    return wire.header(pb.Frame(status=pb.Status(code=pb.AUTH, message=(
        f"this dock has no token, so it serves only the user it runs as (uid {os.getuid()}), and this client runs "
        f"as uid {uid}: run the client as that user, or start the dock's daemons with --token-file and give "
        "the client the same token (a dock with a token serves every user that proves it)"))))


def bind_error(host: str, port: int, flag: str, what: str, e: OSError | None = None) -> OSError:
    """Why `host:port` (set by `flag`) cannot be listened on, and what to do. `e`: the error binding it
    gave; None: find it by binding a plain socket there (gRPC says only that it failed)."""
    if e is None:
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.bind((host, port))
        except OSError as err:
            e = err
    why = "refused" if e is None else os.strerror(e.errno) if e.errno else str(e)
    if e is not None and e.errno == errno.EADDRINUSE:
        why += " (another process, perhaps another dockd, listens there)"
    return OSError(f"cannot listen on {host}:{port} ({flag}, {what}): {why}; give {flag} another port, or 0 for "
                   "a free one")


def watch_pid(pid: int, exited) -> None:
    """Call `exited` when process `pid` ends (a pidfd becomes readable)."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone already (or no pidfd): treat as exited
        loop.call_soon(exited)
        return

    def done() -> None:
        loop.remove_reader(fd)
        os.close(fd)
        exited()

    loop.add_reader(fd, done)
