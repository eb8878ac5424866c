"""TCP: frames and payloads in one stream, to a daemon on any host."""

from __future__ import annotations

import functools
import socket
import ssl
import time

from dockd.net import tls as _tls
from dockd.net import wire
from dockd.net.transport import Transport

_PROBE = b"GET / HTTP/1.0\r\n\r\n"


class TcpTransport(Transport):
    """Frames over TCP (TCP_NODELAY); payloads travel in the frames' bodies. Never spins: on
    loopback, polling for the reply cost 10-30% of bulk throughput (docs/design.md)."""

    name = "tcp"
    auto = True
    fallback = True
    priority = 0

    def open(self, timeout: float) -> socket.socket:
        sock = socket.create_connection((self.endpoint.host, self.endpoint.port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    @property
    def tls(self) -> str:
        return self.ctx.config.tls

    def secure(self, sock: socket.socket, timeout: float) -> _tls.TlsSocket:
        return _tls.wrap_client(sock, _context(self.tls), self.endpoint.host, self.describe(), self.tls, timeout)

    def sniff(self, timeout: float) -> str:
        """Ask the port what it is on a second connection: a dockd daemon sends its challenge first
        thing; anything else (an HTTP server answers the probe) says it is not dockd."""
        got = b""
        try:
            with socket.create_connection((self.endpoint.host, self.endpoint.port), timeout=timeout) as s:
                deadline = time.monotonic() + timeout
                s.sendall(_PROBE)
                while len(got) < 64 and not got.startswith(wire.MAGIC):
                    s.settimeout(max(0.001, deadline - time.monotonic()))
                    chunk = s.recv(64 - len(got))
                    if not chunk:
                        break
                    got += chunk
        except OSError:
            pass
        if not got or wire.MAGIC.startswith(got[:4]):
            return ""  # silent (a stopped daemon?) or dockd itself: nothing is known
        if got.startswith(b"HTTP/"):
            status = got.split(b"\r\n", 1)[0].decode(errors="replace")
            return f"it answers HTTP ({status})"
        return f"it answered {got[:32]!r}"


    def identify(self, first: bytes, timeout: float) -> str:
        """A port that opened with an HTTP/2 SETTINGS frame is a gRPC server: when its health check
        answers with dockd's header, it is a daemon's admin port (`--grpc-port`), and the header names
        the framed port to use instead."""
        if len(first) < 9 or first[3] != 4 or first[5:9] != bytes(4):
            return ""
        framed = _dockd_admin(self.endpoint.host, self.endpoint.port, timeout)
        if framed is None:
            return ""
        use = f"{self.endpoint.host}:{framed}" if framed else "the port its ready line prints as \"port\""
        return (f"the gRPC port of a dockd daemon (health checks and admin: \"grpc_port\" in its ready line, "
                f"--grpc-port), not the port clients connect to: use {use} (--port)")


def _dockd_admin(host: str, port: int, timeout: float) -> int | None:
    """The framed port of the dockd daemon whose gRPC admin port `host:port` is (0: it does not say);
    None when its health check does not answer as dockd's (no `x-dockd-version` header)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"[{host}]:{port}" if ":" in host else f"{host}:{port}") as channel:
        try:
            _, call = health_pb2_grpc.HealthStub(channel).Check.with_call(health_pb2.HealthCheckRequest(),
                                                                         timeout=max(timeout, 0.1))
        except grpc.RpcError:
            return None
        header = dict(call.initial_metadata() or ())
    if "x-dockd-version" not in header:
        return None
    try:
        return int(header.get("x-dockd-port", 0))
    except ValueError:
        return 0


@functools.lru_cache(maxsize=8)
def _context(ca: str) -> ssl.SSLContext:
    """One TLS context per CA file, shared by every connection of this process."""
    return _tls.client_context(ca)
