"""Blocking framed connections from a client to a daemon, and a pool of them.

A `Connection` carries one request at a time (plus one-way frames): it writes
the frame with sendmsg and reads the reply's body straight into one freshly
allocated uint8 tensor, which the decoded tensors are views of.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import resource
import select
import socket
import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np

from dockd import auth, shm, wire
from dockd.client.staging import Staging
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockClosed, DockConnectionError, DockProtocolError, from_status

logger = logging.getLogger(__name__)

_SCRATCH = 64 << 10
_NO_BODY = np.empty(0, dtype=np.uint8)


class RecvPool:
    """Warm receive buffers for large replies.

    Reading into fresh memory runs at page-fault speed (about 1.2 GB/s on the
    development VM, against 3+ GB/s from the socket into warm memory). A reply
    body is handed out as a numpy view of a pooled block; the tensors decoded
    from it keep that view alive, and when the last of them is gone the block
    returns here for the next reply. Up to `max_bytes` are kept, and always the
    last block given back, however big (older blocks are dropped to make room),
    so a steady stream of huge gets reuses it.
    Sizes are rounded up to 8 classes per power of two.
    """

    MIN = 1 << 20

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.pooled = 0
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        if n < self.MIN or self.max_bytes <= 0:
            return np.empty(n, dtype=np.uint8)
        step = max(1, 1 << max(0, (n - 1).bit_length() - 4))
        size = -(-n // step) * step
        block = None
        with self._lock:
            blocks = self._free.get(size)
            if blocks:  # no empty lists are kept
                block = blocks.pop()
                self.pooled -= size
                if not blocks:
                    del self._free[size]
        if block is None:
            block = np.empty(size, dtype=np.uint8)
        view = block[:n]
        weakref.finalize(view, self._give_back, block)
        return view

    def _give_back(self, block: np.ndarray) -> None:
        with self._lock:
            # the block given back last is the likeliest to be asked for next: older ones make room for it
            while self.pooled + block.nbytes > self.max_bytes and self._free:
                size, blocks = next(iter(self._free.items()))
                blocks.pop()
                self.pooled -= size
                if not blocks:
                    del self._free[size]
            self._free.setdefault(block.nbytes, []).append(block)
            self.pooled += block.nbytes


RECV_POOL = RecvPool(int(float(os.environ.get("DOCKD_RECV_POOL_BYTES", 1 << 30))))

SPIN_S = float(os.environ.get("DOCKD_SPIN_US", 200)) / 1e6
"""How long a call on a same-host (Unix) connection polls for the start of its reply before
sleeping in the kernel: a reply that lands while the client is still awake saves a wake-up on
both sides. TCP connections never spin: on loopback it cost 10-30% of bulk throughput
(docs/design.md)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Credentials:
    """What a client proves when it connects (see dockd.auth)."""

    key: bytes | None = None     # the dock's token; None in tokenless mode
    session: bytes = b""         # random per Dock: the leases it takes belong to it
    name: str = ""


class Connection:
    """A TCP connection, or with `unix` a same-host Unix one that can pass descriptors.

    It authenticates as soon as it is connected (the daemon's challenge, our proof,
    the daemon's proof). A call interrupted half-way (an exception, Ctrl-C) leaves
    the connection `busy`: the pool then drops it instead of reusing a stream that
    is out of step."""

    def __init__(self, host: str, port: int, *, unix: str = "", connect_timeout: float = 10.0, max_body: int = 1 << 40,
                 creds: Credentials = Credentials()) -> None:
        # errors name the address the user knows, never the internal socket name
        self.address = f"{host}:{port} (same-host socket)" if unix else f"{host}:{port}"
        self.unix = bool(unix)
        try:
            if unix:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(connect_timeout)
                try:
                    self.sock.connect(shm.unix_address(unix))
                except BaseException:
                    self.sock.close()
                    raise
            else:
                self.sock = socket.create_connection((host, port), timeout=connect_timeout)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            raise DockConnectionError(
                f"cannot connect to dockd at {self.address}: {e.strerror or e}. Is `dockd serve` running there?"
            ) from None
        self.sock.settimeout(None)  # blocking; reads wait in _recv_into (spin, then poll until the deadline)
        self._poll = select.poll()
        self._poll.register(self.sock, select.POLLIN)
        self._deadline: float | None = None
        self._stall: float | None = None  # once a reply's header is in: seconds its body may go without a byte
        self._fds: collections.deque[int] = collections.deque()
        self.max_body = max_body
        self._buf = bytearray(_SCRATCH)
        self._mv = memoryview(self._buf)
        self._lo = self._hi = 0
        self._next_id = 1
        self.broken = False
        self.closed = False
        self.busy = False
        # close() from another thread only shuts the socket down while a call is reading it: the
        # descriptor is released by the calling thread on its way out, so its number cannot be
        # reused by a new socket under a poll() that would then wait on the wrong one forever.
        self._close_lock = threading.Lock()
        self._in_call = False
        self.instance = 0
        try:
            self._handshake(creds, connect_timeout)
        except BaseException:
            self.close()
            raise

    def _handshake(self, creds: Credentials, timeout: float) -> None:
        self._deadline = time.monotonic() + timeout
        try:
            frame, _, fds = self._read_frame()
            _close_all(fds)
            if frame.WhichOneof("kind") != "challenge":
                if frame.status.code != pb.OK:
                    raise from_status(frame.status)
                raise DockProtocolError(f"{self.address} did not start with a dockd challenge: is it a dockd daemon "
                                        "of this version?")
            ch = frame.challenge
            wire.check_protocol(ch.protocol, f"dockd at {self.address}")
            auth.missing_token(ch, creds.key, self.address)
            a = auth.answer(ch, auth.CLIENT, creds.key, session=creds.session, name=creds.name)
            self.send(pb.Frame(auth=a))
            reply, _, fds = self._read_frame()
            _close_all(fds)
            if reply.status.code != pb.OK:
                raise from_status(reply.status)
            auth.check_reply(ch, a, reply.auth_reply, creds.key, self.address)
            self.instance = ch.instance
        except socket.timeout:
            raise _no_answer(f"dockd at {self.address} did not complete the handshake within {timeout:g}s: it accepts "
                             "connections but does not answer (stopped, hung or overloaded?)") from None
        except OSError as e:
            self._raise_io(e)
        finally:
            self._deadline = None

    def close(self) -> None:
        """Close; a thread blocked in call() on this connection wakes with an error."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a reader (poll sees the hang-up)
            except OSError:
                pass
            if not self._in_call:
                self._release()

    def _release(self) -> None:
        self.sock.close()
        _close_all(self._fds)
        self._fds.clear()

    def send(self, frame: pb.Frame, buffers: Sequence = (), body_size: int = 0, fds: Sequence[int] = ()) -> None:
        frame.id = self._next_id
        self._next_id += 1
        if fds:
            frame.fds = len(fds)
        try:
            wire.sendall(self.sock, [wire.header(frame, body_size), *buffers], shm.fds_ancillary(fds))
        except OSError as e:
            self._raise_io(e)

    def call(self, frame: pb.Frame, buffers: Sequence = (), body_size: int = 0, *, fds: Sequence[int] = (),
             timeout: float | None = None, stall: float | None = None) -> tuple[pb.Frame, np.ndarray, list[int]]:
        """Send a request and wait for its reply: (frame, body, descriptors). The caller owns the descriptors.

        `timeout` bounds the wait for the reply's header; with `stall`, a body that is arriving
        may then take longer as long as no `stall` seconds pass without a byte (a large reply is
        not cut off for its size). A reply that does not come in time leaves the connection broken:
        a late answer is never read by anyone. Raises the mapped error on a non-OK status."""
        self._enter()
        self.busy = True
        try:
            self.send(frame, buffers, body_size, fds)
            self._deadline = None if timeout is None else time.monotonic() + timeout
            self._stall = stall if timeout is not None else None
            reply, body, got = self._read_frame()
        except socket.timeout:
            self.broken = True
            raise _no_answer(f"dockd at {self.address} did not answer within {timeout:g}s") from None
        except OSError as e:
            self._raise_io(e)
        finally:
            self._deadline = self._stall = None
            self._leave()
        if reply.id != frame.id and reply.id != 0:
            self.broken = True
            raise DockProtocolError(f"reply id {reply.id} does not match request id {frame.id} from {self.address}")
        self.busy = False  # the reply is read whole: the stream is in step again
        if reply.status.code != pb.OK:
            _close_all(got)
            raise from_status(reply.status)
        return reply, body, got

    def post(self, frame: pb.Frame) -> None:
        """Send a one-way frame (no reply)."""
        self._enter()
        try:
            self.send(frame)
        finally:
            self._leave()

    def _enter(self) -> None:
        with self._close_lock:
            if self.closed:
                raise DockClosed("the dock client was closed while this call was in flight")
            self._in_call = True

    def _leave(self) -> None:
        with self._close_lock:
            self._in_call = False
            if self.closed:
                self._release()

    def _raise_io(self, e: OSError):
        self.broken = True
        if self.closed:
            raise DockClosed("the dock client was closed while this call was in flight") from None
        raise DockConnectionError(f"connection to dockd at {self.address} failed: {e}") from None

    def _fill(self, n: int) -> None:
        """Make at least n bytes available in the scratch buffer."""
        if self._hi - self._lo >= n:
            return
        if len(self._buf) - self._lo < n:
            live = self._hi - self._lo
            new = bytearray(max(n, len(self._buf)))
            new[:live] = self._mv[self._lo : self._hi]
            self._buf, self._mv, self._lo, self._hi = new, memoryview(new), 0, live
        while self._hi - self._lo < n:
            got = self._recv_into(self._mv[self._hi :], SPIN_S if self.unix and self._hi == self._lo else 0.0)
            if got == 0:
                self.broken = True
                if self.closed:
                    raise DockClosed("the dock client was closed while this call was in flight")
                raise DockConnectionError(f"dockd at {self.address} closed the connection (did the daemon stop?)")
            self._hi += got

    def _recv_into(self, mv: memoryview, spin: float = 0.0) -> int:
        """Read what has arrived into mv; wait for it first spinning for `spin` seconds, then
        asleep in poll until the call's deadline. Only the wait for the start of a reply spins:
        inside a large body, polling the socket would contend with the sender for it."""
        spin_end = None
        while True:
            try:
                if not self.unix:
                    return self.sock.recv_into(mv, 0, socket.MSG_DONTWAIT)
                n, anc, flags, _ = self.sock.recvmsg_into([mv], shm._ANC, socket.MSG_DONTWAIT)
                break
            except BlockingIOError:
                pass
            now = time.monotonic()
            if spin_end is None:
                spin_end = now + spin
            if now < spin_end:
                continue
            wait_ms = -1.0 if self._deadline is None else (self._deadline - now) * 1e3
            if self._deadline is not None and wait_ms <= 0 or not self._poll.poll(wait_ms):
                raise socket.timeout("timed out")
        if anc:
            self._fds.extend(shm.recv_fds(anc))
        if flags & socket.MSG_CTRUNC:  # the reply's segments are lost; the stream is out of step
            self.broken = True
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            err = DockConnectionError(
                f"the kernel dropped shared-memory descriptors sent by dockd at {self.address}: this process "
                f"is at its open-file limit ({soft}). Raise it (ulimit -n) or close files it no longer needs."
            )
            err.retry = False  # a limit of this process, not a daemon that went away: re-sending would fail again
            raise err
        return n

    def _read_frame(self) -> tuple[pb.Frame, np.ndarray, list[int]]:
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._lo > len(self._buf) // 2:
            live = self._hi - self._lo
            self._mv[:live] = self._mv[self._lo : self._hi]
            self._lo, self._hi = 0, live
        self._fill(wire.PREFIX.size)
        hlen, blen = wire.parse_prefix(self._buf, self._lo, self.max_body, wire.MAX_REPLY_HEADER)
        self._fill(wire.PREFIX.size + hlen)
        start = self._lo + wire.PREFIX.size
        frame = wire.parse_header(self._mv[start : start + hlen])
        self._lo = start + hlen
        if frame.fds > len(self._fds):
            self.broken = True
            raise DockProtocolError(f"reply announces {frame.fds} descriptors but {len(self._fds)} arrived")
        fds = [self._fds.popleft() for _ in range(frame.fds)]
        if blen == 0:
            return frame, _NO_BODY, fds
        try:
            body = RECV_POOL.take(blen)
            dst = memoryview(body)
            take = min(self._hi - self._lo, blen)
            dst[:take] = self._mv[self._lo : self._lo + take]
            self._lo += take
            pos = take
            while pos < blen:
                if self._stall is not None:  # the daemon answers: the body may take as long as it keeps coming
                    self._deadline = time.monotonic() + self._stall
                got = self._recv_into(dst[pos:])
                if got == 0:
                    self.broken = True
                    raise DockConnectionError(f"dockd at {self.address} closed the connection mid-reply")
                pos += got
        except BaseException:  # the reply's descriptors are ours: never leak them, whatever interrupted us
            _close_all(fds)
            raise
        return frame, body, fds


def _close_all(fds) -> None:
    for fd in fds:
        os.close(fd)


def _no_answer(message: str) -> DockConnectionError:
    """A daemon that accepted the connection but did not answer in time (`timed_out`): unlike a
    refused or closed connection, it may be alive, only stopped or overloaded."""
    err = DockConnectionError(message)
    err.timed_out = True
    return err


def timed_out(exc: BaseException) -> bool:
    """Whether `exc` says a daemon did not answer in time (rather than that it cannot be reached)."""
    return bool(getattr(exc, "timed_out", False))


class Pool:
    """Idle connections to one daemon; a thread checks one out per call."""

    def __init__(self, host: str, port: int, *, connect_timeout: float, unix: str = "",
                 creds: Credentials = Credentials()) -> None:
        self.host, self.port, self.unix = host, port, unix
        self.connect_timeout = connect_timeout
        self.creds = creds
        self.staging = Staging() if unix else None  # same-host puts write here
        self._unpins: list[int] = []  # segments of this daemon we no longer map, to tell it
        self._idle: list[Connection] = []
        self._all: set[Connection] = set()
        self._lock = threading.Lock()
        self.closed = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def transport(self) -> str:
        return "shm" if self.unix else "tcp"

    def get(self, timeout: float | None = None) -> Connection:
        """An idle connection, or a new one (made within `timeout` seconds, at most connect_timeout)."""
        with self._lock:
            if self.closed:
                raise DockClosed("the dock client is closed; create a new one with dockd.connect()")
            if self._idle:
                return self._idle.pop()
        limit = self.connect_timeout if timeout is None else max(0.001, min(timeout, self.connect_timeout))
        conn = Connection(self.host, self.port, unix=self.unix, connect_timeout=limit, creds=self.creds)
        with self._lock:
            self._all.add(conn)
            if self.closed:
                conn.close()
                raise DockClosed("the dock client is closed")
        return conn

    def put(self, conn: Connection) -> None:
        with self._lock:
            if conn.broken or conn.closed or conn.busy or self.closed:
                self._all.discard(conn)
                conn.close()
            else:
                self._idle.append(conn)

    def discard(self, conn: Connection) -> None:
        with self._lock:
            self._all.discard(conn)
        conn.close()

    def unpin(self, sid: int) -> None:
        """A zero-copy mapping of this daemon's segment `sid` is gone (runs in a finalizer)."""
        with self._lock:
            self._unpins.append(sid)

    def take_unpins(self) -> list[int]:
        with self._lock:
            out, self._unpins = self._unpins, []
        return out

    def close(self) -> None:
        with self._lock:
            self.closed = True
            conns, self._all, self._idle = list(self._all), set(), []
        for c in conns:
            c.close()
        if self.staging is not None:
            self.staging.close()
