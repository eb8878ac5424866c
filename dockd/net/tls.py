"""TLS on the framed TCP port (`dockd serve --tls-cert FILE --tls-key FILE`; off by default).

A daemon with a certificate opens every TCP connection with one plain frame, the *TLS
preamble*: a challenge without a nonce, carrying the daemon's instance and protocol (what
the controller's address probe reads) and the name of its same-host socket, whose status
says that TLS follows. Then it waits for the peer's TLS handshake; the dockd handshake
(challenge, HMAC proofs) and every frame after it run inside TLS. So both mismatches are
told at once, not by a timeout:

- a client without TLS settings meets the preamble: on the daemon's host it goes to the
  same-host socket the preamble names (shared memory and a Unix socket, which never leave
  the host: no TLS needed); elsewhere, or when it may use TCP only (`DOCKD_TRANSPORT=tcp`),
  it raises `DockAuthError` naming the address and what to set (`tls=`, `DOCKD_TLS_CA`,
  `--tls-ca`);
- a client with TLS settings meets a plain challenge and refuses to go on in the clear.

Certificates are checked against the CA file the client (or daemon) is given, not against
host names: a dock typically shares one cluster certificate (self-signed, or signed by a
private CA) among its daemons. A certificate file given as the CA is trusted as itself
(partial chains are accepted), so a self-signed cluster certificate needs no separate CA.
Same-host clients on the Unix socket (shared memory) never leave the host and use no TLS.
"""

from __future__ import annotations

import dataclasses
import logging
import select
import socket
import ssl
import time
from collections.abc import Sequence

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockAuthError, DockValueError
from dockd.net import wire

logger = logging.getLogger(__name__)

PREAMBLE_MARK = "dockd-tls-v1"
_CHUNK = 256 << 10  # small buffers of one frame are joined up to this size into one TLS write


@dataclasses.dataclass(frozen=True, slots=True)
class LinkTls:
    """How a daemon reaches another daemon over TLS: the context and the CA file it names in errors."""

    context: ssl.SSLContext
    ca: str


def preamble(instance: int, unix: str = "") -> bytes:
    """The plain frame a TLS daemon sends first on every TCP connection (`unix`: its same-host socket)."""
    frame = pb.Frame(challenge=pb.Challenge(protocol=wire.PROTOCOL_VERSION, instance=instance, unix=unix),
                     status=pb.Status(code=pb.AUTH, message=f"{PREAMBLE_MARK}: this daemon speaks TLS"))
    return wire.header(frame)


def is_preamble(frame: pb.Frame) -> bool:
    return (frame.WhichOneof("kind") == "challenge" and not frame.challenge.nonce
            and frame.status.message.startswith(PREAMBLE_MARK))


class NeedsTls(DockAuthError):
    """A TLS daemon met without TLS settings; `same_host`: the daemon's same-host socket, which a client
    on its host may use instead ("": it serves none)."""

    same_host = ""


def needs_tls(address: str, who: str = "this client", same_host: str = "") -> NeedsTls:
    err = NeedsTls(
        f"dockd at {address} uses TLS (its daemons run with --tls-cert), but {who} has no TLS settings: give it "
        "the CA file that signed the daemons' certificate (dockd.connect(..., tls='ca.pem'), DOCKD_TLS_CA=ca.pem, "
        "or --tls-ca for the dockd command; a self-signed cluster certificate is its own CA)"
        + (". Clients on the daemon's own host need none: they use its same-host socket, which never leaves the "
           "host (unless they may use TCP only: DOCKD_TRANSPORT=tcp)" if who == "this client" else ""))
    err.same_host = same_host
    return err


def not_tls(address: str, who: str = "this client") -> DockAuthError:
    return DockAuthError(
        f"dockd at {address} does not use TLS, but {who} is set to require it (tls= / DOCKD_TLS_CA / --tls-ca): "
        "start every daemon with --tls-cert and --tls-key, or connect without TLS settings")


def untrusted(address: str, ca: str, e: ssl.SSLError) -> DockAuthError:
    why = getattr(e, "verify_message", "") or getattr(e, "reason", "") or str(e)
    return DockAuthError(
        f"the TLS certificate of dockd at {address} is not trusted by {ca} ({why}): give the CA file that signed "
        "the daemons' certificate (or that self-signed certificate itself)")


def _check_file(path: str, what: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise DockValueError(f"cannot read the TLS {what} {path!r}: {e.strerror or e}") from None


def client_context(ca: str) -> ssl.SSLContext:
    """What a client (or a daemon connecting to another) checks a daemon's certificate with."""
    _check_file(ca, "CA file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # a cluster certificate: checked against the CA, not against host names
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a certificate given as the CA is trusted as itself
    try:
        ctx.load_verify_locations(cafile=ca)
    except ssl.SSLError as e:
        raise DockValueError(f"the TLS CA file {ca!r} holds no usable certificate ({e.reason or e})") from None
    return ctx


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """A daemon's side: its certificate (chain) and private key."""
    _check_file(cert, "certificate")
    _check_file(key, "key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise DockValueError(f"cannot use the TLS certificate {cert!r} with the key {key!r} ({e.reason or e})") from None
    check_dates(cert)
    return ctx


def check_dates(cert: str, now: float | None = None) -> None:
    """Warn when the certificate (the first of the file) is expired or not valid yet: every client and
    warehouse checking it refuses the TLS handshake then, so the daemon says so when it starts."""
    try:  # (the ssl module's own PEM decoder: no dependency beyond the standard library)
        info = ssl._ssl._test_decode_cert(cert)  # type: ignore[attr-defined]
        after, before = ssl.cert_time_to_seconds(info["notAfter"]), ssl.cert_time_to_seconds(info["notBefore"])
    except (AttributeError, KeyError, ValueError, OSError, ssl.SSLError) as e:
        logger.debug("[tls] could not read the dates of %s: %s", cert, e)
        return
    now = time.time() if now is None else now
    day = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(after if after < now else before))
    if after < now:
        logger.warning("[tls] the certificate %s expired on %s: clients and warehouses refuse it (\"certificate has "
                       "expired\"); give --tls-cert a renewed certificate (and its CA to the clients if it changed) "
                       "and restart", cert, day)
    elif before > now:
        logger.warning("[tls] the certificate %s is not valid before %s: clients and warehouses refuse it until "
                       "then (is this host's clock right?)", cert, day)


class TlsSocket:
    """A TLS connection where a client's `Connection` expects a socket: non-blocking reads
    (`recv_into` with MSG_DONTWAIT raises BlockingIOError when nothing has arrived; data
    OpenSSL holds already decrypted is read before the socket is polled, which the
    connection always does first), `sendmsg` of a frame's buffers (written whole, waiting
    while the socket is full: a blocking send), and the rest of what it uses."""

    __slots__ = ("_s", "_fd")

    def __init__(self, ssock: ssl.SSLSocket) -> None:
        ssock.setblocking(False)
        self._s = ssock
        self._fd = ssock.fileno()

    def fileno(self) -> int:
        return self._fd

    def settimeout(self, timeout: float | None) -> None:
        """(Kept non-blocking: the connection waits with poll, sends wait here.)"""

    def recv_into(self, buf, nbytes: int = 0, flags: int = 0) -> int:
        while True:
            try:
                return self._s.recv_into(buf, nbytes)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                if flags & socket.MSG_DONTWAIT:
                    raise BlockingIOError("nothing to read") from None
                select.select([self._fd], [], [])
            except ssl.SSLZeroReturnError:
                return 0

    def sendmsg(self, buffers: Sequence, ancdata: Sequence = (), flags: int = 0) -> int:
        """Write every buffer (no descriptors travel over TCP); returns the bytes written."""
        total = 0
        pending: list = []
        size = 0
        for b in buffers:
            n = memoryview(b).nbytes
            total += n
            if n >= _CHUNK:
                if pending:
                    self._write(b"".join(pending))
                    pending, size = [], 0
                self._write(b)
            else:
                pending.append(b)
                size += n
                if size >= _CHUNK:
                    self._write(b"".join(pending))
                    pending, size = [], 0
        if pending:
            self._write(pending[0] if len(pending) == 1 else b"".join(pending))
        return total

    def sendall(self, data) -> None:
        self._write(data)

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            try:
                n = self._s.send(view)
            except ssl.SSLWantWriteError:
                select.select([], [self._fd], [])
                continue
            except ssl.SSLWantReadError:
                select.select([self._fd], [], [])
                continue
            view = view[n:]

    def shutdown(self, how: int) -> None:
        # the socket's own shutdown: wakes a reader in poll without tearing down the TLS state under it
        socket.socket.shutdown(self._s, how)

    def close(self) -> None:
        self._s.close()

    def getpeername(self):
        return self._s.getpeername()

    def version(self) -> str | None:
        return self._s.version()


def wrap_client(sock: socket.socket, ctx: ssl.SSLContext, host: str, address: str, ca: str,
                timeout: float) -> TlsSocket:
    """The client's TLS handshake on a connected socket (within `timeout` seconds)."""
    sock.settimeout(max(timeout, 0.001))
    try:
        ssock = ctx.wrap_socket(sock, server_hostname=host or None)
    except ssl.SSLCertVerificationError as e:
        raise untrusted(address, ca, e) from None
    except ssl.SSLError as e:
        raise DockAuthError(f"the TLS handshake with dockd at {address} failed ({e.reason or e})") from None
    return TlsSocket(ssock)
