"""`CallScope`: what one call of a client has checked out, so that cancelling the call closes it."""

from __future__ import annotations

import threading

from dockd.errors import DockClosed
from dockd.net.connection import Connection


class CallScope:
    """The connections one call has checked out right now, so that cancelling the call (an
    AsyncDock coroutine) closes those and nothing another call is using."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conns: set[Connection] = set()
        self.cancelled = False

    def enter(self, conn: Connection) -> None:
        with self._lock:
            self._conns.add(conn)
            if not self.cancelled:
                return
        conn.close()
        raise DockClosed("the call was cancelled")

    def leave(self, conn: Connection) -> None:
        with self._lock:
            self._conns.discard(conn)

    def cancel(self) -> None:
        """Wake the call's thread: its connections close, and it makes no new request."""
        with self._lock:
            self.cancelled = True
            conns = list(self._conns)
        for conn in conns:
            conn.close()
