"""A blocking framed connection from a client to a daemon (a pool of them: `dockd.net.pool`).

A `Connection` carries one request at a time (plus one-way frames): it writes
the frame with sendmsg and reads the reply's body straight into a warm
receive buffer (`dockd.net.recv_pool`), which the decoded tensors are views
of. How its socket is opened and read (TCP, or a same-host Unix socket that
passes descriptors) is its `Transport`'s business (`dockd.net.transport`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockAuthError, DockClosed, DockConnectionError, DockError, DockProtocolError, from_status
from dockd.net import auth, tls, wire
from dockd.net.recv_pool import recv_pool
from dockd.net.reply_waits import ReplyWaits, on_cpu
from dockd.net.same_host import fds_ancillary
from dockd.net.tcp import TcpTransport
from dockd.net.transport import ALIVE_EVERY_S, Context, Endpoint, Transport

logger = logging.getLogger(__name__)

_SCRATCH = 64 << 10


class _Forks:
    """How many times this process is a fork of the one it started as (os.register_at_fork): a
    child shares its parent's sockets, so the pools made before the fork are not its to use."""

    count: ClassVar[int] = 0

    @classmethod
    def forked(cls) -> None:
        cls.count += 1


os.register_at_fork(after_in_child=_Forks.forked)


def forks() -> int:
    """How many forks away this process is from the one it started as (compare with a saved value)."""
    return _Forks.count


_NO_BODY = np.empty(0, dtype=np.uint8)
_OK = pb.OK
CHALLENGE_GRACE_S = 1.0
"""Seconds a new TCP connection waits for the daemon's challenge before it asks the port, on a second
connection, what it is (a dockd daemon sends its challenge at once; an HTTP server waits for a request)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Credentials:
    """What a client proves when it connects (see dockd.net.auth)."""

    key: bytes | None = None     # the dock's token; None in tokenless mode
    session: bytes = b""         # random per Dock: the leases it takes belong to it
    name: str = ""


class Connection:
    """A connection to one daemon over `transport` (`via`; default TCP).

    It authenticates as soon as it is connected (the daemon's challenge, our proof,
    the daemon's proof). A call interrupted half-way (an exception, Ctrl-C) leaves
    the connection `busy`: the pool then drops it instead of reusing a stream that
    is out of step."""

    def __init__(self, host: str, port: int, *, transport: Transport | None = None, connect_timeout: float = 10.0,
                 max_body: int = 1 << 40, creds: Credentials = Credentials()) -> None:
        self.via = transport if transport is not None else TcpTransport(Endpoint(host, port), Context())
        self.address = self.via.describe()
        try:
            self.sock = self.via.open(connect_timeout)
        except OSError as e:
            err = DockConnectionError(
                f"cannot connect to dockd at {self.address}: {e.strerror or e}. Is `dockd serve` running there?"
            )
            # nothing listens (yet)
            err.refused = e.errno in (errno.ECONNREFUSED, errno.ENOENT)
            raise err from None
        self.sock.settimeout(None)  # blocking; reads wait in _recv_into (spin, then poll until the deadline)
        self._poll: Any = select.poll()  # (Any: a test puts a stand-in here)
        self._poll.register(self.sock, select.POLLIN)
        self._deadline: float | None = None
        self._stall: float | None = None  # once a reply's header is in: seconds its body may go without a byte
        self._alive: Callable[[], bool | float] | None = None  # asked when the deadline passes: wait on?
        self._wait: float | None = None  # the call's timeout (a send that makes no progress for it asks `_alive`)
        self._fds: collections.deque[int] = collections.deque()
        self.max_body = max_body
        self._buf = bytearray(_SCRATCH)
        self._mv = memoryview(self._buf)
        self._lo = self._hi = 0
        self._spin = self.via.spin_s  # seconds the wait for the next frame's first bytes spins
        self._waits = ReplyWaits(self.via.spin_s)
        self._reply_at = 0.0  # when the first bytes of the frame being read arrived
        self._next_id = 1
        self.broken = False
        self.closed = False
        self.busy = False
        # close() from another thread only shuts the socket down while a call is reading it: the
        # descriptor is released by the calling thread on its way out, so its number cannot be
        # reused by a new socket under a poll() that would then wait on the wrong one forever.
        self._close_lock = threading.Lock()
        self._forks = _Forks.count  # (closed in a forked child: its parent's socket is not shut down)
        self._in_call = False
        self.instance = 0
        try:
            self._handshake(creds, connect_timeout)
        except BaseException:
            self.close()
            raise

    def _handshake(self, creds: Credentials, timeout: float) -> None:
        started = time.monotonic()
        try:
            self._await_challenge(started, timeout)
            frame, _, fds = self._read_frame()
            _close_all(fds)
            frame = self._tls(frame, started, timeout)
            if frame.WhichOneof("kind") != "challenge":
                if frame.status.code != pb.OK:  # refused before the challenge (another user, at a dock without a token)
                    raise self._refused(from_status(frame.status))
                raise DockProtocolError(f"{self.address} did not start with a dockd challenge: is it a dockd daemon "
                                        "of this version?")
            ch = frame.challenge
            wire.check_protocol(ch.protocol, f"dockd at {self.address}")
            auth.token_modes_match(ch, creds.key, self.address)
            a = auth.answer(ch, auth.CLIENT, creds.key, session=creds.session, name=creds.name)
            self.send(pb.Frame(auth=a))
            reply, _, fds = self._read_frame()
            _close_all(fds)
            if reply.status.code != pb.OK:
                raise self._refused(from_status(reply.status))
            auth.check_reply(ch, a, reply.auth_reply, creds.key, self.address)
            self.instance = ch.instance
        except TimeoutError:
            raise _no_answer(f"dockd at {self.address} did not complete the handshake within {timeout:.3g}s: it accepts "
                             "connections but does not answer (stopped, hung or overloaded?)") from None
        except OSError as e:
            self._raise_io(e)
        finally:
            self._deadline = None

    def _refused(self, err: DockError) -> DockError:
        """A daemon's refusal of the handshake, naming the daemon."""
        return DockAuthError(f"dockd at {self.address} refused this client: {err}") if isinstance(err, DockAuthError) else err

    def _tls(self, frame: pb.Frame, started: float, timeout: float) -> pb.Frame:
        """TLS where the daemon's preamble asks for it (dockd.net.tls): the handshake, then the challenge
        that follows inside TLS. Refuses a mismatch either way at once (DockAuthError)."""
        if not tls.is_preamble(frame):
            if self.via.tls:
                raise tls.not_tls(self.address)
            return frame
        if not self.via.tls:
            raise tls.needs_tls(self.address, same_host=frame.challenge.unix)
        if self._hi != self._lo:
            raise DockProtocolError(f"dockd at {self.address} sent data after its TLS preamble before the TLS handshake")
        self.sock = self.via.secure(self.sock, started + timeout - time.monotonic())
        self._poll = select.poll()
        self._poll.register(self.sock, select.POLLIN)
        self._fill(1)
        frame, _, fds = self._read_frame()
        _close_all(fds)
        return frame

    def _await_challenge(self, started: float, timeout: float) -> None:
        """Wait for the first bytes of the daemon's challenge, and refuse a peer that is not dockd: one
        whose first bytes are not a dockd frame's, or (TCP) one that sends nothing for
        CHALLENGE_GRACE_S and answers a probe as something else (an HTTP server)."""
        grace = CHALLENGE_GRACE_S
        if grace < timeout / 2:
            self._deadline = started + grace
            try:
                self._fill(1)
            except TimeoutError:
                what = self.via.sniff(min(grace, timeout - grace))
                if what:
                    raise DockProtocolError(f"{self.address} is not a dockd daemon: {what}. Point the client at the "
                                            "port `dockd serve` prints as \"port\" in its ready line") from None
        self._deadline = started + timeout
        self._fill(1)
        first = bytes(self._mv[self._lo : min(self._hi, self._lo + len(wire.MAGIC))])
        if not wire.MAGIC.startswith(first):
            seen = bytes(self._mv[self._lo : min(self._hi, self._lo + 32)])
            what = self.via.identify(seen, max(0.1, min(CHALLENGE_GRACE_S, started + timeout - time.monotonic())))
            if what:
                raise DockProtocolError(f"{self.address} is {what}")
            raise DockProtocolError(f"{self.address} is not a dockd daemon: it sent {seen!r} where a dockd "
                                    "challenge starts with b'DKD1'")

    def close(self) -> None:
        """Close; a thread blocked in call() on this connection wakes with an error."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
            if self._forks == _Forks.count:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)  # wakes a reader (poll sees the hang-up)
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
            if self._alive is None:
                wire.sendall(self.sock, [wire.header(frame, body_size), *buffers], fds_ancillary(fds))
            else:
                self._send_watched([wire.header(frame, body_size), *buffers], fds_ancillary(fds))
        except TimeoutError:
            raise
        except OSError as e:
            self._raise_io(e)

    def _send_watched(self, buffers: Sequence, ancillary: list) -> None:
        """wire.sendall, but a daemon that takes no byte for the call's timeout is asked about as
        a reply that does not come is (`alive`): a stopped one does not block a put's send for ever.
        The poll and the deadline are made once the socket is full (a small frame goes at once)."""
        assert self._alive is not None and self._wait is not None
        bufs = [memoryview(b).cast("B") for b in buffers if len(b)]
        writable = None
        deadline = None  # (from the first time the socket is full since the daemon last took bytes)
        while bufs:
            try:
                wire.consume(bufs, self.sock.sendmsg(bufs[: wire.IOV_MAX], ancillary, socket.MSG_DONTWAIT))
                ancillary = []
                deadline = None
                continue
            except BlockingIOError:
                pass
            if writable is None:
                writable = select.poll()
                writable.register(self.sock, select.POLLOUT)
            if deadline is None:
                deadline = time.monotonic() + self._wait
            left = deadline - time.monotonic()
            if left > 0 and writable.poll(left * 1e3):
                continue
            if time.monotonic() >= deadline:
                deadline = time.monotonic() + self._wait_more()

    def _wait_more(self) -> float:
        """Seconds more to wait for a daemon that is late (`alive` says), else TimeoutError."""
        more = self._alive() if self._alive is not None else False
        if not more:
            raise TimeoutError("timed out")
        return ALIVE_EVERY_S if more is True else more

    def call(self, frame: pb.Frame, buffers: Sequence = (), body_size: int = 0, *, fds: Sequence[int] = (),
             timeout: float | None = None, stall: float | None = None,
             alive: Callable[[], bool | float] | None = None) -> tuple[pb.Frame, np.ndarray, list[int]]:
        """Send a request and wait for its reply: (frame, body, descriptors). The caller owns the descriptors.

        `timeout` bounds the wait for the reply's header; with `stall`, a body that is arriving
        may then take longer as long as no `stall` seconds pass without a byte (a large reply is
        not cut off for its size). With `alive`, a reply that does not come in time is waited for
        more each time `alive()` says so: True (the daemon is there, working on it) for ALIVE_EVERY_S
        seconds, a number for that many; so is a send that makes no progress for `timeout` seconds.
        A reply that does not come in time leaves the connection broken: a late answer is never
        read by anyone. Raises the mapped error on a non-OK status."""
        self._enter()
        self.busy = True
        started = time.monotonic()
        kind = frame.WhichOneof("kind")
        request_id = self._next_id  # (the id send gives the frame)
        try:
            if timeout is not None:
                self._alive, self._wait = alive, timeout
            self.send(frame, buffers, body_size, fds)
            self.via.idle()  # (while the daemon works on the request)
            sent = self._reply_at = time.monotonic()
            if timeout is not None:
                self._deadline, self._stall = sent + timeout, stall
            self._spin = self._waits.spin(kind)
            reply, body, got = self._read_frame()
            self._waits.waited(kind, self._reply_at - sent)
        except TimeoutError:
            self.broken = True
            probed = " nor a probe (stopped, hung or overloaded?)" if self._alive is not None else ""
            raise _no_answer(f"dockd at {self.address} did not answer within "
                             f"{time.monotonic() - started:.3g}s{probed}") from None
        except DockConnectionError:  # (already says what failed, and whether a retry can help)
            self.broken = True
            raise
        except OSError as e:
            self._raise_io(e)
        finally:
            self._deadline = self._stall = self._alive = self._wait = None
            self._leave()
        reply_id = reply.id
        if reply_id != request_id and reply_id != 0:
            self.broken = True
            raise DockProtocolError(f"reply id {reply_id} does not match request id {request_id} from {self.address}")
        self.busy = False  # the reply is read whole: the stream is in step again
        if reply.status.code != _OK:
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
            first = self._hi == self._lo
            got = self._recv_into(self._mv[self._hi :], self._spin if first else 0.0)
            if first:
                self._reply_at = time.monotonic()
            if got == 0:
                self.broken = True
                if self.closed:
                    raise DockClosed("the dock client was closed while this call was in flight")
                raise DockConnectionError(f"dockd at {self.address} closed the connection (did the daemon stop?)")
            self._hi += got

    def _recv_into(self, mv: memoryview, spin: float = 0.0) -> int:
        """Read what has arrived into mv; wait for it first spinning for `spin` seconds, then
        asleep in poll until the call's deadline. Only the wait for the start of a reply spins:
        inside a large body, polling the socket would contend with the sender for it. How the
        spin went is told to `ReplyWaits.spun`."""
        spin_end = began = cpu0 = -1.0  # when the spin ends, when it began and this thread's CPU time then (-1: not yet)
        while True:
            try:
                got = self.via.recv_into(self.sock, mv, self._fds)
            except BlockingIOError:
                got = -1
            except DockConnectionError:
                self.broken = True
                raise
            if got >= 0:
                if cpu0 >= 0:  # (the reply came while spinning)
                    self._waits.spun(on_cpu(began, cpu0))
                elif began >= 0 and time.monotonic() - spin_end > max(ReplyWaits.LOST_S, spin / 2):
                    self._waits.spun(False)  # (it ran out, and the reply came long after: see ReplyWaits)
                return got
            now = time.monotonic()
            if spin_end < 0:
                spin_end = now + spin
                if spin:
                    began, cpu0 = now, time.thread_time()
            if now < spin_end:
                continue
            cpu0 = -1.0
            wait_ms = -1.0 if self._deadline is None else (self._deadline - now) * 1e3
            if self._deadline is not None and wait_ms <= 0 or not self._poll.poll(wait_ms):
                self._deadline = time.monotonic() + self._wait_more()

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
        nfds = frame.fds
        if nfds > len(self._fds):
            self.broken = True
            raise DockProtocolError(f"reply announces {nfds} descriptors but {len(self._fds)} arrived")
        fds = [self._fds.popleft() for _ in range(nfds)] if nfds else []
        if blen == 0:
            return frame, _NO_BODY, fds
        try:
            body = recv_pool().take(blen)
            dst = memoryview(body)  # type: ignore[arg-type]  # numpy declares __buffer__ only for Python 3.12+
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
