"""A client's pool of connections to one daemon, and how a transport's requests are sent on it.

A `Pool` keeps idle `Connection`s to one daemon over one `Transport` (made per daemon endpoint:
the controller, each warehouse) and lends one to each call, from any thread. `call` sends a
frame and returns the reply; `send` sends what the transport made of a put or a fetch (a
`dockd.net.transport.Request`: what to send, and what to do with the answer) and returns
what the request's answer step makes of the reply.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockClosed, DockConnectionError, DockError
from dockd.net import wire
from dockd.net.connection import Connection, Credentials, forks
from dockd.net.transport import ALIVE_EVERY_S, ANSWER_GRACE_S, PROBE_S, Reply, Request, Transport

_NO_CREDENTIALS = Credentials()


def _replaced(address: str) -> DockConnectionError:
    err = DockConnectionError(f"the connections to dockd at {address} were replaced; the call goes to the new ones")
    err.replaced = True
    return err


def _instead(request: Request, exc: BaseException) -> Request:
    """The request to send instead of `request`, which failed with `exc` (raised again when its
    transport has none)."""
    other = request.failed(exc) if request.failed is not None else None
    if other is None:
        raise exc
    return other


class Pool:
    """Idle connections to one daemon over one transport; a thread checks one out per call."""

    def __init__(self, transport: Transport, *, connect_timeout: float, creds: Credentials = _NO_CREDENTIALS) -> None:
        self.via = transport
        self.host, self.port = transport.endpoint.host, transport.endpoint.port
        self.connect_timeout = connect_timeout
        self.creds = creds
        self._idle: list[Connection] = []
        self._all: set[Connection] = set()
        self._lock = threading.Lock()
        self._probing = threading.Lock()
        self._answered = -ALIVE_EVERY_S  # when the daemon last answered a probe (monotonic)
        self.closed = False
        self.retired = False  # another pool took its place: no new calls, those in flight finish
        self._pid, self._forks = os.getpid(), forks()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _check_process(self) -> None:
        if self._forks != forks():
            raise DockClosed(
                f"this dock client was made in process {self._pid}, and this process ({os.getpid()}) is a fork of "
                "it: the client's connections belong to the parent (both reading one socket would mix up their "
                "answers). Make a client in this process with dockd.connect(address): in a DataLoader worker, in "
                "the dataset's __iter__ or a worker_init_fn")

    @property
    def transport(self) -> str:
        """The transport's name, as logs, stats and metrics give it ("shm", "tcp", ...)."""
        return self.via.name

    def call(self, frame: pb.Frame, buffers: Sequence = (), size: int = 0, *, fds: Sequence[int] = (),
             timeout: float | None = None, scope: Any = None, stall: float | None = None,
             alive: Callable[[], bool | float] | None = None) -> tuple[pb.Frame, np.ndarray, list[int]]:
        """One request on a pooled connection (a broken or interrupted one is dropped, never reused).
        `timeout` bounds making a connection (if none is idle) and the wait for the reply together;
        `stall`, `alive`: see Connection.call; `scope`: a CallScope that may cancel it. Segments the
        daemon lent that this process no longer maps are reported with it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = self.get(timeout)
        try:
            return self._call(conn, frame, buffers, size, fds, deadline, stall, alive, scope)
        finally:
            self.put(conn)

    def _call(self, conn: Connection, frame: pb.Frame, buffers: Sequence, size: int, fds: Sequence[int],
              deadline: float | None, stall: float | None, alive: Callable[[], bool | float] | None,
              scope: Any = None) -> tuple[pb.Frame, np.ndarray, list[int]]:
        unpins = self.via.take_unpins()
        if unpins:
            frame.unpin.extend(unpins)
        if scope is not None:
            scope.enter(conn)
        try:
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            return conn.call(frame, buffers, size, fds=fds, timeout=left, stall=stall, alive=alive)
        finally:
            if scope is not None:
                scope.leave(conn)

    def send(self, request: Request) -> Any:
        """Send what this pool's transport made of a call (`Transport.put_request`, `fetch_request`)
        and return what the request's `answer` makes of the reply; a failed request goes to its
        `failed`, which may give another one to send instead (see `Request`)."""
        r = request
        while True:
            deadline = None if r.timeout is None else time.monotonic() + r.timeout
            try:
                conn = self.get(r.timeout)
            except BaseException as e:
                r = _instead(r, e)
                continue
            try:
                try:
                    got = self._call(conn, r.frame, r.buffers, r.size, r.fds, deadline, r.stall,
                                     r.watch(self) if r.watch is not None else None)
                except BaseException as e:
                    r = _instead(r, e)
                    continue
                try:
                    return r.answer(Reply(*got))
                finally:
                    follow = r.then(got[0]) if r.then is not None else None
                    if follow is not None:
                        conn.post(follow)
            finally:
                self.put(conn)

    def ask(self, frame: pb.Frame, *, scope: Any = None) -> tuple[pb.Frame, np.ndarray, list[int]]:
        """A request without a timeout of its own: its answer is waited for as long as the daemon
        answers probes (`answers`), so a stopped or hung one ends it (a connection error) instead of
        holding the caller until it runs again."""
        return self.call(frame, timeout=ANSWER_GRACE_S, scope=scope, alive=self.answers)

    def get(self, timeout: float | None = None) -> Connection:
        """An idle connection, or a new one (made within `timeout` seconds, at most connect_timeout)."""
        self._check_process()
        with self._lock:
            if self.retired:
                raise _replaced(self.address)
            if self.closed:
                raise DockClosed("the dock client is closed; create a new one with dockd.connect()")
            if self._idle:
                return self._idle.pop()
        limit = self.connect_timeout if timeout is None else max(0.001, min(timeout, self.connect_timeout))
        conn = Connection(self.host, self.port, transport=self.via, connect_timeout=limit, creds=self.creds)
        with self._lock:
            gone = self.closed or self.retired
            if not gone:
                self._all.add(conn)
        if gone:
            conn.close()
            raise _replaced(self.address) if self.retired else DockClosed("the dock client is closed")
        return conn

    def answers(self) -> bool:
        """Whether the daemon is there: it answered a Hello on a new connection within PROBE_S
        seconds, now or in the last ALIVE_EVERY_S seconds (one probe at a time per pool). A daemon
        busy with a long request answers; one that is stopped or hung does not."""
        with self._probing:
            if time.monotonic() - self._answered < ALIVE_EVERY_S:
                return True
            try:
                conn = Connection(self.host, self.port, transport=self.via, connect_timeout=PROBE_S, creds=self.creds)
                try:
                    conn.call(pb.Frame(hello=pb.Hello(client="probe", protocol=wire.PROTOCOL_VERSION)),
                              timeout=PROBE_S)
                finally:
                    conn.close()
            except DockConnectionError:
                return False
            except DockError:
                pass  # (an answer, if not a welcome one: the daemon is there)
            self._answered = time.monotonic()
            return True

    def put(self, conn: Connection) -> None:
        with self._lock:
            if not (conn.broken or conn.closed or conn.busy or self.closed or self.retired):
                self._idle.append(conn)
                return
        self.discard(conn)

    def retire(self) -> None:
        """Another pool took this one's place (a reconnect, a better transport). Idle connections
        close now; a call in flight finishes on its connection, which closes after it: closing it
        under the call could cut off the answer to a request the daemon applied (a confirm then
        looks failed and is sent again, too late). A call that picks this pool up after this is
        told to go to its successor (a DockConnectionError with `replaced` set)."""
        with self._lock:
            self.retired = True
            idle, self._idle = self._idle, []
            self._all.difference_update(idle)
            drained = not self._all and not self.closed
        for c in idle:
            c.close()
        if drained:
            self.close()

    def discard(self, conn: Connection) -> None:
        with self._lock:
            self._all.discard(conn)
            drained = self.retired and not self._all and not self.closed
        conn.close()
        if drained:
            self.close()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            conns, self._all, self._idle = list(self._all), set(), []
        for c in conns:
            c.close()
        self.via.close()
