"""Who may talk to a dock: tokens, roles, and the challenge-response that proves them.

A dock is one trust domain. With a token (`dockd serve --token-file`), every
connection proves it holds the token before anything else is accepted:

    daemon -> peer   Challenge{nonce_d}
    peer -> daemon   Auth{role, nonce_p, mac = HMAC(key, "dockd-auth-v1" | role | nonce_d | nonce_p)}
    daemon -> peer   AuthReply{HMAC(key, "dockd-auth-ok-v1" | role | nonce_p | nonce_d)}

so the token never crosses the wire, a recorded exchange cannot be replayed
(fresh nonces on both sides), and the client learns that the daemon holds the
token too. Roles:

- "client": what every `dockd.connect()` proves, with the dock's token (or
  nothing in tokenless mode).
- "daemon": what a warehouse proves to its controller, and what the
  controller's requests to warehouses ride on. Its key is the daemon token
  (`--daemon-token-file`), never the clients' token: every client holds that
  one, and a client that could prove the daemon role could register a fake
  warehouse or commit samples with no data behind them. Without a daemon token
  it is a per-dock secret that only the dock's own daemons hold: `start_local`
  hands it to the daemons it starts, and `dockd serve --controller` writes it
  to a file of its user's (`daemon_secret_path`) that `dockd serve --join` on
  the same host reads; a warehouse on another host needs the daemon token.
  Several controllers of one host (`--controllers`) share one such secret
  (`controllers_secret`); controllers on several hosts need the daemon token.

The gRPC admin surface checks the same token on every call (`grpc_metadata`
builds the header); the standard health service stays open, as probes need.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import os
import pathlib
import secrets
import socket
import stat
import time
from collections.abc import Sequence

from dockd._proto import dockd_pb2 as pb
from dockd.config import env
from dockd.errors import DockAuthError, DockConfigError, DockValueError
from dockd.net.wire import PROTOCOL_VERSION, check_protocol

logger = logging.getLogger(__name__)

CLIENT, DAEMON = "client", "daemon"
NONCE = 32
MIN_TOKEN = 16
GRPC_HEADER = "x-dockd-auth"
GRPC_WINDOW = 300.0  # seconds a gRPC call's timestamp may be off
#: Why a daemon refused someone: a wrong token proof, an unknown role, no proof in time, a
#: same-host connection of another user, a client sending daemon messages, an unsigned gRPC call.
FAILURE_REASONS = ("bad_proof", "role", "timeout", "uid", "daemon_message", "grpc")


def load_token(path: str | os.PathLike, what: str = "token") -> bytes:
    """A token from a file (surrounding whitespace dropped); refuses short or unreadable ones."""
    p = pathlib.Path(path)
    try:
        raw = p.read_bytes().strip()
        mode = p.stat().st_mode
    except OSError as e:
        raise DockValueError(f"cannot read the {what} file {p}: {e.strerror or e}") from None
    if len(raw) < MIN_TOKEN:
        raise DockValueError(f"the {what} in {p} is {len(raw)} bytes; use at least {MIN_TOKEN} random bytes, e.g. "
                             "`openssl rand -hex 32 > FILE`")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("[auth] %s file %s is readable by other users (mode %o); chmod 600 it", what, p, mode & 0o777)
    return raw


def client_token(token: str | bytes | None = None) -> bytes | None:
    """The token a client proves: the argument, else $DOCKD_TOKEN, else the file $DOCKD_TOKEN_FILE."""
    if token is None:
        token = env("DOCKD_TOKEN") or None
    if token is None and env("DOCKD_TOKEN_FILE"):
        return load_token(env("DOCKD_TOKEN_FILE"))
    if token is None:
        return None
    raw = token.encode() if isinstance(token, str) else bytes(token)
    if len(raw.strip()) < MIN_TOKEN:
        raise DockValueError(f"a dock token has at least {MIN_TOKEN} bytes")
    return raw.strip()


def client_session() -> bytes:
    """A new client's session id (the leases it takes belong to it): 16 random bytes, the first
    never zero. A controller gives a claimed session that starts with a zero byte to no one (it keeps
    those for connections that claim none, each its own), so a client that drew one (1 in 256) was a
    session per connection: its leases taken over one could not be confirmed over another."""
    return bytes([1 + secrets.randbelow(255)]) + secrets.token_bytes(15)


def _netns() -> str:
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return "0"


def daemon_secret_path(port: int) -> pathlib.Path:
    """Where a tokenless controller on `port` keeps its per-dock daemon secret (this user only)."""
    base = env("XDG_RUNTIME_DIR", "/tmp")
    return pathlib.Path(base) / f"dockd-{os.getuid()}" / f"daemon-{_netns()}-{port}.secret"


def write_daemon_secret(port: int, secret: bytes) -> pathlib.Path:
    path = daemon_secret_path(port)
    _private_dir(path.parent)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secret)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def controllers_secret(controllers: Sequence[str]) -> bytes:
    """The daemon secret of tokenless controllers of one dock (`--controllers` without
    --daemon-token-file): one per user and network namespace, shared by every such controller of
    this host, so that a warehouse joining any of them proves itself to all. Controllers on other
    hosts cannot share it: they need --daemon-token-file, and are refused at start without it."""
    elsewhere = [a for a in controllers if not _on_this_host(a.rpartition(":")[0])]
    if elsewhere:
        raise DockValueError(
            f"--controllers names controllers on other hosts ({', '.join(elsewhere)}), so the daemons need a "
            "daemon token to trust each other: create one (`openssl rand -hex 32 > FILE; chmod 600 FILE`) and "
            "give the same --daemon-token-file to every controller and warehouse of the dock (see the README, "
            "\"Several nodes\")")
    path = daemon_secret_path(0).with_name(f"controllers-{_netns()}.secret")
    _private_dir(path.parent)
    while True:
        try:
            st = path.stat()
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise DockValueError(f"{path} must belong to this user with mode 600 to hold the dock's daemon secret")
            secret = path.read_bytes()
            if len(secret) == 32:
                return secret
            raise DockValueError(f"{path} does not hold a daemon secret (remove it, then start the controllers again)")
        except FileNotFoundError:
            pass
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, secrets.token_bytes(32))
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # whole or not at all, and only if no other controller made it first
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)


def _on_this_host(host: str) -> bool:
    """Whether `host` names an address of this machine (loopback, or one it can bind)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, kind, proto, _, addr in infos:
        if ipaddress.ip_address(str(addr[0]).split("%")[0]).is_loopback:
            return True
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.bind((addr[0], 0, *addr[2:]))
            return True
        except OSError:
            continue
    return False


def _private_dir(path: pathlib.Path) -> None:
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise DockValueError(f"{path} must belong to this user with mode 700 to hold the dock's daemon secret")


def read_daemon_secret(port: int) -> bytes | None:
    path = daemon_secret_path(port)
    try:
        st = path.stat()
        if st.st_uid != os.getuid():
            return None
        return path.read_bytes()
    except OSError:
        return None


def loopback_peer_uid(sock) -> int | None:
    """The uid owning the other end of a TCP connection from this host (Linux: /proc/net/tcp*),
    None when it cannot be told (another host, or no /proc)."""
    import ipaddress
    import socket

    try:
        peer, here = sock.getpeername()[:2], sock.getsockname()[:2]
    except OSError:
        return None
    ip = ipaddress.ip_address(peer[0])
    if not ip.is_loopback and not (ip.version == 6 and ip.ipv4_mapped and ip.ipv4_mapped.is_loopback):
        return None

    def key(addr: tuple) -> str:  # the kernel's hex form: address bytes as stored in 32-bit words, then the port
        raw = socket.inet_pton(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, addr[0])
        words = b"".join(raw[k : k + 4][::-1] for k in range(0, len(raw), 4))
        return f"{words.hex().upper()}:{addr[1]:04X}"

    want_local, want_remote = key(peer), key(here)
    for table in ("/proc/net/tcp6", "/proc/net/tcp") if ":" in peer[0] else ("/proc/net/tcp",):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if cols[1] == want_local and cols[2] == want_remote:
                        return int(cols[7])
        except OSError:
            return None
    return None


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


@dataclasses.dataclass(slots=True)
class ServerAuth:
    """What a daemon accepts. client_key None: clients need no token; daemon_key None: no
    role checks (only with --insecure and no token)."""

    client_key: bytes | None
    daemon_key: bytes | None
    failures: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))
    """Refusals by reason (for metrics; see FAILURE_REASONS)."""

    def failed(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1

    @property
    def roles(self) -> bool:
        return self.daemon_key is not None

    def challenge(self, instance: int) -> pb.Challenge:
        return pb.Challenge(nonce=secrets.token_bytes(NONCE), protocol=PROTOCOL_VERSION, token=self.client_key is not None,
                            instance=instance)

    def verify(self, challenge: pb.Challenge, auth: pb.Auth) -> pb.AuthReply:
        """Check an Auth against the challenge this connection got; the reply proving our key."""
        check_protocol(auth.protocol, f"the {auth.role or 'peer'} {auth.name or ''}".rstrip())
        role = auth.role
        if role not in (CLIENT, DAEMON):
            self.failed("role")
            raise DockAuthError(f"unknown role {role!r}")
        key = self.client_key if role == CLIENT else self.daemon_key
        if key is None:  # tokenless clients; or no roles at all (--insecure without a token)
            return pb.AuthReply()
        if len(auth.nonce) != NONCE or not hmac.compare_digest(
                auth.mac, _mac(key, b"dockd-auth-v1", role.encode(), challenge.nonce, auth.nonce)):
            self.failed("bad_proof")
            raise DockAuthError(
                "authentication failed: this dock needs the token it was started with"
                if role == CLIENT else ("authentication as a dockd daemon failed: wrong daemon token or secret (the daemon role takes "
                      "--daemon-token-file, the same file on every daemon; the dock's client token is not enough)")
            )
        return pb.AuthReply(mac=_mac(key, b"dockd-auth-ok-v1", role.encode(), auth.nonce, challenge.nonce))


def answer(challenge: pb.Challenge, role: str, key: bytes | None, *, session: bytes = b"", name: str = "") -> pb.Auth:
    """The Auth a connecting peer sends in reply to a daemon's Challenge."""
    nonce = secrets.token_bytes(NONCE)
    mac = _mac(key, b"dockd-auth-v1", role.encode(), challenge.nonce, nonce) if key is not None else b""
    return pb.Auth(role=role, nonce=nonce, mac=mac, session=session, name=name, protocol=PROTOCOL_VERSION)


def check_reply(challenge: pb.Challenge, auth: pb.Auth, reply: pb.AuthReply, key: bytes | None, where: str) -> None:
    """The daemon proved it holds our key too (a fake daemon cannot)."""
    if key is None:
        return
    want = _mac(key, b"dockd-auth-ok-v1", auth.role.encode(), auth.nonce, challenge.nonce)
    if not hmac.compare_digest(reply.mac, want):
        raise DockAuthError(f"the daemon at {where} did not prove it holds the dock's token: it is not this dock")


def token_modes_match(challenge: pb.Challenge, key: bytes | None, where: str) -> None:
    """A client's token against what the daemon's challenge says of its own, before any proof is sent."""
    if challenge.token and key is None:
        raise DockAuthError(
            f"the dock at {where} requires a token: pass dockd.connect(address, token=...) or set DOCKD_TOKEN_FILE "
            "to the file the daemons were started with (--token-file)"
        )
    if key is not None and not challenge.token:  # (a client with a token talks only to a daemon that proves it)
        raise DockAuthError(
            f"the dock at {where} runs without a token (its daemons have no --token-file), but this client was "
            "given one (token=, DOCKD_TOKEN or DOCKD_TOKEN_FILE): connect without it, or start the dock's daemons "
            "with --token-file"
        )


def token_proof(challenge: pb.Challenge, key: bytes | None) -> bytes:
    """What a warehouse joining a controller tells of the dock's token (its --token-file): a proof over
    the controller's challenge of this link, empty without a token (`check_token_proof`)."""
    return _mac(key, b"dockd-token-v1", challenge.nonce) if key is not None else b""


def check_token_proof(challenge: pb.Challenge, proof: bytes, key: bytes | None, who: str) -> None:
    """A controller refuses a warehouse whose --token-file is not its own (`token_proof` over the challenge it
    sent that warehouse's link): clients that hold the controller's token would be refused there, so
    their puts would fail on the node and not at the start."""
    if key is None and not proof:
        return
    if key is None:
        why = "this controller has none"
    elif not proof:
        why = "it has none, but this controller has one"
    elif hmac.compare_digest(proof, token_proof(challenge, key)):
        return
    else:
        why = "its token is not this controller's"
    raise DockConfigError(
        f"{who} and this controller were given different --token-file ({why}): clients that hold one dock token "
        "would be refused by one of them. Give every daemon of the dock the same --token-file (or none to all), "
        "then restart the one that differs")


# -- gRPC --------------------------------------------------------------------------------------
def grpc_metadata(token: bytes, method: str) -> tuple[tuple[str, str], ...]:
    """Metadata that authenticates one call to `method` (e.g. "/dockd.v1.Admin/Stats")."""
    ts, nonce = f"{time.time():.3f}", secrets.token_hex(16)
    mac = _mac(token, b"dockd-grpc-v1", method.encode(), ts.encode(), nonce.encode()).hex()
    return ((GRPC_HEADER, f"{ts}:{nonce}:{mac}"),)


class GrpcNonces:
    """Recently seen gRPC nonces, so a captured call cannot be replayed within the window."""

    def __init__(self, limit: int = 100_000) -> None:
        self.seen: dict[str, float] = {}
        self.limit = limit

    def check(self, token: bytes, method: str, value: str | None) -> None:
        try:
            ts, nonce, mac = (value or "").split(":")
            when = float(ts)
        except ValueError:
            raise DockAuthError(f"missing or malformed {GRPC_HEADER} metadata") from None
        now = time.time()
        if abs(now - when) > GRPC_WINDOW:
            raise DockAuthError("the call's timestamp is too far from this daemon's clock")
        want = _mac(token, b"dockd-grpc-v1", method.encode(), ts.encode(), nonce.encode()).hex()
        if not hmac.compare_digest(mac, want):
            raise DockAuthError("wrong token")
        if nonce in self.seen:
            raise DockAuthError("replayed call")
        if len(self.seen) >= self.limit:
            self.seen = {n: t for n, t in self.seen.items() if now - t < GRPC_WINDOW}
        self.seen[nonce] = now
